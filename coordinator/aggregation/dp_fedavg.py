"""DP-FedAvg (McMahan, Ramage, Talwar and Zhang, ICLR 2018) as the coordinator's aggregation rule (--dp-noise).

    w <- w + server_lr * ( sum_c clip(delta_c, C) + N(0, sigma^2 C^2) ) / K

with one contribution c per worker in the step (its updates in the buffer summed first) and K the
configured updates per step, not the number that arrived: equal weights, no sample counts or staleness
weights, so that no worker's influence exceeds C. The maths is ``privacy.dp.dp_fedavg_step``; the
privacy it spends is booked per expert by ``coordinator.privacy_ledger``.
"""
from __future__ import annotations

from coordinator.aggregation.base import AggregationParams, Aggregator, StateDict, Update, tensors_of
from privacy.dp import DPFedAvgSettings, dp_fedavg_step, noise_generator, worker_contributions


def dp_fedavg_aggregator(settings: DPFedAvgSettings, denominator: int) -> Aggregator:
    """The rule for steps of ``denominator`` updates, drawing its noise from the OS's entropy."""
    generator = noise_generator()

    def dp_fedavg(current: StateDict, updates: list[Update], params: AggregationParams) -> StateDict:
        # decoded here, each once: clipping needs a contribution's norm before any of it is added
        named = [(u.contributor or f"update-{i}", dict(tensors_of(u.delta))) for i, u in enumerate(updates)]
        dp_fedavg_step(current, worker_contributions(named), settings, max(denominator, len(named)),
                       params.server_lr, generator)
        return current

    return dp_fedavg
