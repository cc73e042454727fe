"""FedAsync (Xie et al., 2019): apply each update as soon as it arrives, mixed in at weight alpha.

    w <- w + alpha * server_lr / (1 + staleness_decay * staleness) * delta

Xie et al. mix the worker's model in, w <- (1 - a_t) w + a_t w_new with a_t = alpha * s(t - tau); for a worker
that started from the current version (w_new = w + delta) that is the line above. With alpha = 1 it is the
original FedMoE tool's rule (``--async-alpha 1``). The coordinator's default sets alpha = 1 / N for N workers
active on the expert: each of them trains from (nearly) the same weights, so at full weight their N updates
add up to an N-times larger step from stale bases, which overshoots and oscillates; at 1 / N they add up to
their mean, FedAvg's step (docs/history/benchmarks.md, "Several workers on one expert").

Given several updates it applies them one after another, each with its own staleness weight, in place on
``current`` (no copy of the model).
"""
from __future__ import annotations

from coordinator.aggregation.base import AggregationParams, StateDict, Update, add_deltas, staleness_weight


def fedasync(current: StateDict, updates: list[Update], params: AggregationParams) -> StateDict:
    step = params.alpha * params.server_lr
    add_deltas(current, [(update.delta, step * staleness_weight(update.staleness, params.staleness_decay))
                         for update in updates])
    return current
