"""FedBuff (Nguyen et al., 2022): buffer K updates, apply their weighted mean once.

    w <- w + server_lr * sum_i (n_i / N) * s(tau_i) * delta_i

with n_i the samples behind update i, N = sum n_i, and s(tau) = 1 / (1 + decay * tau)
the same staleness weight as FedAsync. A buffer whose updates all report zero
samples falls back to equal weights. The result does not depend on arrival order.
Updated in place on ``current``, one update after another (each tensor gets the same additions in
the same order as tensor-major, so the result is bit-identical), so a stored update is decoded in
one pass and memory stays at one model plus one decoded update.
"""
from __future__ import annotations

from coordinator.aggregation.base import AggregationParams, StateDict, Update, add_delta, staleness_weight


def sample_weights(updates: list[Update]) -> list[float]:
    total = sum(u.num_samples for u in updates)
    if total == 0:
        return [1.0 / len(updates)] * len(updates)
    return [u.num_samples / total for u in updates]


def fedbuff(current: StateDict, updates: list[Update], params: AggregationParams) -> StateDict:
    if not updates:
        return current
    weights = [params.server_lr * w * staleness_weight(u.staleness, params.staleness_decay)
               for w, u in zip(sample_weights(updates), updates)]
    for weight, update in zip(weights, updates):
        add_delta(current, update.delta, weight)
    return current
