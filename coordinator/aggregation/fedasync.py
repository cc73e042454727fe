"""FedAsync (Xie et al., 2019): apply each update as soon as it arrives.

    w <- w + server_lr / (1 + staleness_decay * staleness) * delta

This is the rule of the original FedMoE tool. Given several updates it applies
them one after another, each with its own staleness weight, in place on ``current`` (no copy of the model).
"""
from __future__ import annotations

from coordinator.aggregation.base import AggregationParams, StateDict, Update, add_deltas, staleness_weight


def fedasync(current: StateDict, updates: list[Update], params: AggregationParams) -> StateDict:
    add_deltas(current, [(update.delta, params.server_lr * staleness_weight(update.staleness, params.staleness_decay))
                         for update in updates])
    return current
