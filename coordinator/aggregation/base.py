"""What every aggregation rule sees: the current weights and a list of updates.

Aggregators are pure maths: no I/O, no clocks. *When* updates are applied and
how many at a time is the coordinator's policy (``Coordinator._aggregate``).
``current`` is the aggregator's to update in place and return (the coordinator loads
a fresh copy for each step), so a step never holds two copies of a full model; a
delta may be a lazy mapping that reads one tensor at a time.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Update:
    """One worker's delta, as the aggregator needs it."""

    delta: Mapping[str, torch.Tensor]
    num_samples: int
    staleness: int
    """Expert versions made since the worker pulled the weights it trained from."""
    contributor: str | None = None
    """Who sent it (the worker id): DP-FedAvg clips each contributor's updates of a step together."""


@dataclass(frozen=True)
class AggregationParams:
    server_lr: float = 1.0
    """Global step size applied to every aggregated delta."""
    staleness_decay: float = 0.1
    """Stale updates are weighted by 1 / (1 + staleness_decay * staleness)."""
    alpha: float = 1.0
    """fedasync's mixing weight (Xie et al. 2019) in (0, 1]: the share of each update applied as it arrives.
    The coordinator sets it per step (``--async-alpha``; by default 1 / the workers on the expert)."""
    staleness_grace: int = 0
    """fedasync: versions of staleness that are on time, not discounted (Xie et al.'s hinge function): with N
    workers on an expert an update is normally N - 1 versions old, the others having pushed while it trained.
    The coordinator's default sets it to N - 1; 0 discounts every version (the original rule)."""

    def __post_init__(self) -> None:
        if not self.server_lr > 0:
            raise ValueError(f"server_lr must be > 0, got {self.server_lr}")
        if not self.staleness_decay >= 0:
            raise ValueError(f"staleness_decay must be >= 0, got {self.staleness_decay}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.staleness_grace < 0:
            raise ValueError(f"staleness_grace must be >= 0, got {self.staleness_grace}")


def staleness_weight(staleness: int, decay: float, grace: int = 0) -> float:
    """Older updates count less, smoothly: 1 / (1 + decay * staleness), the original system's rule.

    With ``grace`` b > 0 it is Xie et al.'s hinge function (Asynchronous Federated Optimization, 2019, sec. 5):
    1 up to b versions behind, then 1 / (1 + decay * (staleness - b)); only lateness beyond b counts."""
    return 1.0 / (1.0 + decay * max(0, staleness - grace))


def tensors_of(delta: Mapping[str, torch.Tensor]) -> Iterable[tuple[str, torch.Tensor]]:
    """A delta's (name, tensor) pairs; decoded in one pass when the delta offers ``decoded_items``
    (coordinator.checks.adapters.CompressedUpdate), which is several times cheaper than tensor by tensor."""
    decoded_items = getattr(delta, "decoded_items", None)
    return decoded_items() if decoded_items is not None else delta.items()


def add_delta(current: StateDict, delta: Mapping[str, torch.Tensor], alpha: float) -> None:
    """``current[name] += alpha * delta[name]`` for every tensor of ``delta``, in its order, in place. A delta
    that can add itself (``CompressedUpdate.add_to``: decoded a cache-sized chunk at a time) does; the values
    and the ``add_`` of each tensor are the same either way, so the result is bit-identical."""
    add_to = getattr(delta, "add_to", None)
    if add_to is not None and add_to(current, alpha):
        return
    for name, value in tensors_of(delta):
        current[name].add_(value, alpha=alpha)


def add_deltas(current: StateDict, weighted: list[tuple[Mapping[str, torch.Tensor], float]]) -> None:
    """``add_delta`` of each (delta, alpha) in order. Consecutive deltas of a type that can add several at
    once (``CompressedUpdate.add_together``: each group of tensors gets all of them while it is in cache) do
    so; every tensor still gets the same additions in the same order, so the result is bit-identical."""
    start = 0
    while start < len(weighted):
        kind = type(weighted[start][0])
        end = start + 1
        while end < len(weighted) and type(weighted[end][0]) is kind:
            end += 1
        together = getattr(kind, "add_together", None)
        if end - start < 2 or together is None or not together(current, weighted[start:end]):
            for delta, alpha in weighted[start:end]:
                add_delta(current, delta, alpha)
        start = end


def weighted_sum(manifest: Iterable[tuple[str, tuple[int, ...]]],
                 weighted: list[tuple[Mapping[str, torch.Tensor], float]]) -> dict[str, torch.Tensor]:
    """``sum alpha * delta`` over ``weighted``, in fp32, from zeros shaped as ``manifest`` (``add_deltas``' order)."""
    total = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in manifest}
    add_deltas(total, weighted)
    return total


class Aggregator(Protocol):
    def __call__(self, current: StateDict, updates: list[Update], params: AggregationParams) -> StateDict: ...
