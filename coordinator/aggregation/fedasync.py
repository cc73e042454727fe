"""FedAsync (Xie et al., 2019): apply each update as soon as it arrives, mixed in at weight alpha.

    w <- w + alpha * server_lr * s(staleness) * delta,    s(t) = 1 / (1 + staleness_decay * max(0, t - grace))

Xie et al. mix the worker's model in, w <- (1 - a_t) w + a_t w_new with a_t = alpha * s(t - tau); for a worker
that started from the current version (w_new = w + delta) that is the line above; s is their hinge staleness
function (flat for ``grace`` versions, then decaying). With alpha = 1 and grace 0 it is the original FedMoE tool's
rule (``--async-alpha 1``).

The coordinator's default sets alpha = 1 / N and grace = N - 1 for N workers on the expert
(``coordinator.steps.AggregationSteps.params_for``). Each of them trains from (nearly) the same weights, so at
full weight their N updates add up to an N-times larger step from stale bases, which overshoots and oscillates;
at 1 / N they add up to their mean, FedAvg's step. While one worker trains, the other N - 1 push, so an update
N - 1 versions old is on time: discounting it too (grace 0) shrank that mean step to 0.67 of FedAvg's at N = 6
(decay 0.1); only lateness beyond a round of the others counts (docs/history/benchmarks.md, "Several workers
on one expert").

Given several updates it applies them one after another, each with its own staleness weight, in place on
``current`` (no copy of the model).
"""
from __future__ import annotations

from coordinator.aggregation.base import AggregationParams, StateDict, Update, add_deltas, staleness_weight


def fedasync(current: StateDict, updates: list[Update], params: AggregationParams) -> StateDict:
    step = params.alpha * params.server_lr
    add_deltas(current, [(update.delta, step * staleness_weight(update.staleness, params.staleness_decay,
                                                                 params.staleness_grace))
                         for update in updates])
    return current
