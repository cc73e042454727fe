"""FedBuff (Nguyen et al., 2022): buffer K updates, apply their weighted mean once.

    w <- w + server_lr * sum_i (n_i / N) * s(tau_i) * delta_i

with n_i the samples behind update i, N = sum n_i, and s(tau) = 1 / (1 + decay * tau)
the same staleness weight as FedAsync. A buffer whose updates all report zero
samples falls back to equal weights. The result does not depend on arrival order.
Updated in place on ``current``: every tensor gets the updates' additions in buffer order (the same
floats as tensor-major). Stored int8 updates are decoded a cache-sized group of tensors at a time and
that group of the weights gets all K of them while it is in cache (``base.add_deltas``), so memory
stays at one model plus a few small buffers.
"""
from __future__ import annotations

from coordinator.aggregation.base import AggregationParams, StateDict, Update, add_deltas, staleness_weight


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
    add_deltas(current, [(update.delta, weight) for weight, update in zip(weights, updates)])
    return current
