"""Byzantine-robust rules for buffered (fedbuff) rounds, chosen by name (``--robust``).

A plain mean lets one bad update move the expert anywhere: a worker that sends its delta
scaled by -10 outweighs nine honest ones. These rules bound what a minority can do:

- ``clip``: every delta is first clipped to the median L2 norm of the buffer, then the
  sample-weighted FedBuff mean is taken. Bounds the *size* of a bad update, not its direction.
- ``median``: coordinate-wise median (Yin et al., 2018). Each coordinate stays within the honest
  updates' range while fewer than half the buffer is bad.
- ``trimmed_mean``: per coordinate, drop the ``k = floor(trim_fraction * n)`` largest and smallest
  values and average the rest; within the honest range while at most ``k`` updates are bad.

Staleness keeps its meaning: each delta is scaled by ``1 / (1 + decay * staleness)`` *before*
the robust statistic, so a stale update pulls less, and ``server_lr`` scales the result.
``median`` and ``trimmed_mean`` ignore ``num_samples``: a weight a worker reports itself is one
more thing an attacker controls, so every update counts once. ``clip`` keeps FedBuff's sample
weights (it is FedBuff with bounded inputs). All rules are pure and independent of arrival order.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from coordinator.aggregation.base import AggregationParams, Aggregator, StateDict, Update, staleness_weight
from coordinator.aggregation.fedbuff import sample_weights


@dataclass(frozen=True)
class RobustParams:
    trim_fraction: float = 0.2
    """trimmed_mean drops floor(trim_fraction * n) values at each end of every coordinate."""

    def __post_init__(self) -> None:
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction}")


CombineRule = Callable[[list[Update], AggregationParams, RobustParams], StateDict]
"""Turns a buffer of updates into one staleness-weighted delta (server_lr not applied yet)."""


NORM_CHUNK = 1 << 20  # values per float64 chunk in l2_norm (8 MiB)


def l2_norm(tensors: Mapping[str, Tensor]) -> float:
    """The L2 norm of all tensors together, as if flattened into one vector; finite for finite input."""
    # Per tensor in float32 (fast: the coordinator does this for every push, and a full update is a
    # whole model). Its sum of squares overflows for values of ~1e19 and up (two 3e38 updates gave an
    # Inf norm, and an Inf median switched the norm check off): then that tensor is summed again in
    # float64, in chunks that keep the float64 copy small. The sum across tensors is a Python float.
    squares = 0.0
    for t in tensors.values():
        norm = float(torch.linalg.vector_norm(t))
        if math.isinf(norm):  # squares are monotonic: a finite result means nothing overflowed
            norm = math.sqrt(sum(float(torch.linalg.vector_norm(chunk, dtype=torch.float64)) ** 2
                                 for chunk in t.reshape(-1).split(NORM_CHUNK)))
        squares += norm ** 2
    return math.sqrt(squares)


def _stacked(updates: Sequence[Update], params: AggregationParams, name: str) -> torch.Tensor:
    """One tensor per update, staleness-weighted, stacked along a new first axis (sorted later)."""
    return torch.stack([u.delta[name] * staleness_weight(u.staleness, params.staleness_decay) for u in updates])


def _sorted_values(updates: Sequence[Update], params: AggregationParams, name: str) -> torch.Tensor:
    # Sorting first makes every later reduction see the same order whatever order updates came in.
    return _stacked(updates, params, name).sort(dim=0).values


def coordinate_median(updates: list[Update], params: AggregationParams, robust: RobustParams) -> StateDict:
    """Per coordinate, the middle value; the mean of the two middle ones for an even count."""
    n = len(updates)
    out = {}
    for name in updates[0].delta:
        values = _sorted_values(updates, params, name)
        out[name] = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
    return out


def trimmed_mean(updates: list[Update], params: AggregationParams, robust: RobustParams) -> StateDict:
    """Per coordinate, the mean of what is left after dropping the k largest and k smallest values."""
    n = len(updates)
    k = trim_count(n, robust.trim_fraction)
    return {name: _sorted_values(updates, params, name)[k:n - k].mean(dim=0) for name in updates[0].delta}


def trim_count(n: int, trim_fraction: float) -> int:
    """Values dropped at each end; always leaves at least one."""
    return min(math.floor(trim_fraction * n), (n - 1) // 2)


def clipped_mean(updates: list[Update], params: AggregationParams, robust: RobustParams) -> StateDict:
    """FedBuff's sample-weighted mean after clipping every delta to the buffer's median norm."""
    norms = [l2_norm(u.delta) for u in updates]
    limit = sorted(norms)[(len(norms) - 1) // 2]  # lower median: an actual honest norm when most are honest
    scales = [1.0 if norm <= limit or norm == 0 else limit / norm for norm in norms]
    weights = [w * s * staleness_weight(u.staleness, params.staleness_decay)
               for w, s, u in zip(sample_weights(updates), scales, updates)]
    out = {}
    for name in updates[0].delta:
        # Summing in a canonical order (by weight then norm) keeps the result bit-identical under reordering.
        order = sorted(range(len(updates)), key=lambda i: (weights[i], norms[i]))
        total = torch.zeros_like(updates[0].delta[name])
        for i in order:
            total.add_(updates[i].delta[name], alpha=weights[i])
        out[name] = total
    return out


ROBUST_RULES: dict[str, CombineRule] = {"clip": clipped_mean, "median": coordinate_median,
                                        "trimmed_mean": trimmed_mean}
"""``--robust`` choices besides ``none`` (plain FedBuff)."""


def robust_fedbuff(current: StateDict, updates: list[Update], params: AggregationParams,
                   rule: CombineRule, robust: RobustParams = RobustParams()) -> StateDict:
    """w <- w + server_lr * rule(updates): one buffered step with a robust combination."""
    if not updates:
        return {name: t.clone() for name, t in current.items()}
    step = rule(updates, params, robust)
    return {name: t + params.server_lr * step[name].to(t.dtype) for name, t in current.items()}


def robust_aggregator(name: str, trim_fraction: float = 0.2) -> Aggregator:
    """The ``Aggregator`` for ``--robust NAME`` (buffered rounds)."""
    return partial(robust_fedbuff, rule=ROBUST_RULES[name], robust=RobustParams(trim_fraction))
