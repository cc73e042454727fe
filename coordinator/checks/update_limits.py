"""What the root refuses in an update, said once, so that a relay refuses the same before its 202.

The root refuses (422) an update whose values are not finite (``coordinator.checks.adapters.checked_norm``), whose norm
is over its ``--norm-check reject`` limit (``coordinator.checks.norm_check.judge_norm``), and one whose aggregation step
would overflow float32 (``check_step_result``, called by ``coordinator.steps`` on the step it computes). A relay
acknowledges a worker's update before the root sees it, inside a combined batch, so it must apply the same rules
first (coordinator/relay/checks.py); ``UpdateLimits`` is the part of the root's configuration those rules read,
sent to a relay when it registers (``POST /api/v1/relays``).

Why a step is checked as ``weights + server_lr * delta`` at a relay: every aggregator the root offers moves the
weights by ``server_lr`` times a combination of its updates whose weights sum to at most 1 (FedAsync: the staleness
weight s <= 1; FedBuff: sum of n_i / N * s_i <= 1; the median and trimmed mean: within the updates' own values,
element by element). ``w + lr * sum c_i d_i = (1 - C) w + sum c_i (w + lr d_i)`` with ``C = sum c_i <= 1`` is then
a convex combination of finite values when each ``w + lr d_i`` is finite: checking each update alone promises
every combination of them.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from coordinator.checks.adapters import non_finite_tensor
from coordinator.aggregation.base import add_deltas, tensors_of
from coordinator.checks.flat_weights import flat_offsets, load_flat
from coordinator.checks.norm_check import NormPolicy
from protocol.errors import InvalidUpdate
from protocol.streaming import FileTensors
from protocol.tensors import StateDict, load_file

NORM_SCALE = "norm_scale"
"""Key of the factor ``--norm-check clip`` scaled an update by, in the meta recorded with it."""


@dataclass(frozen=True)
class UpdateLimits:
    """The root's settings its refusals depend on (what a relay learns when it registers)."""

    server_lr: float = 1.0
    """The root's --server-lr: a step moves the weights by at most this times one update."""
    norm: NormPolicy = field(default_factory=NormPolicy)
    """The root's --norm-check, --norm-factor, --norm-history and --norm-warmup."""
    dp: bool = False
    """The root runs worker-level DP (--dp-noise): it clips each worker's update, so a relay forwards one worker's
    update per batch, lossless (coordinator/relay/forwarder.py)."""
    secure_aggregation: bool = False
    """The root runs --secure-aggregation: with ``dp``, a relay must too (its cohorts are DP cohorts)."""
    noise_multiplier: float | None = None
    """With ``dp``: the root's sigma (--dp-noise), announced in a relay's DP cohorts."""
    clip_norm: float | None = None
    """With ``dp``: the root's C (--dp-clip)."""

    def to_json(self) -> dict[str, Any]:
        return {"server_lr": self.server_lr, "norm": asdict(self.norm), "dp": self.dp,
                "secure_aggregation": self.secure_aggregation, "noise_multiplier": self.noise_multiplier,
                "clip_norm": self.clip_norm}

    @classmethod
    def from_json(cls, data: Any) -> UpdateLimits:
        """ValueError on anything that is not what ``to_json`` writes (a root of another release, a bad file)."""
        try:
            raw = data["norm"]
            norm = NormPolicy(str(raw["mode"]), float(raw["factor"]), int(raw["history"]), int(raw["warmup"]))
            dp = data.get("dp", False)  # a root before relays took DP updates does not say
            secure = data.get("secure_aggregation", False)  # nor one before relays ran DP cohorts
            sigma, clip = (None if data.get(k) is None else float(data[k]) for k in ("noise_multiplier", "clip_norm"))
            limits = cls(float(data["server_lr"]), norm, dp=dp, secure_aggregation=secure, noise_multiplier=sigma,
                         clip_norm=clip)
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"not update limits: {data!r:.200} ({exc})") from None
        for name, flag in (("dp", dp), ("secure_aggregation", secure)):
            if not isinstance(flag, bool):
                raise ValueError(f"update limits: {name} must be true or false, got {flag!r:.50}")
        if any(v is not None and not (math.isfinite(v) and v > 0) for v in (sigma, clip)):
            raise ValueError(f"update limits: noise_multiplier and clip_norm must be positive, got {sigma}, {clip}")
        if not limits.server_lr > 0 or norm.mode not in ("off", "reject", "clip") or not norm.factor > 1 \
                or not 1 <= norm.warmup <= norm.history:
            raise ValueError(f"update limits out of range: {data!r:.200}")
        return limits


def check_step_result(new: Mapping[str, torch.Tensor], update_id: str, expert: str) -> None:
    """Refuse (422 ``result_not_finite``) weights a step would make that are not finite in float32.

    Two finite pushes of 3e38 summed to +Inf in float32, and an expert that is Inf cannot be pulled, merged or
    trained. Nothing is recorded when this raises."""
    bad = non_finite_tensor(new)
    if bad is not None:
        raise InvalidUpdate(f"applying update {update_id!r} would make tensor {bad!r} of expert {expert!r} overflow "
                            "to Inf/NaN (float32); it was not recorded. Check the worker's training (learning rate, "
                            "divergence) and send a smaller update", reason="result_not_finite", tensor=bad)


SAFE_MAGNITUDE = 0.999 * float(torch.finfo(torch.float32).max)
"""A float32 sum of magnitude below this rounds to a finite value (the margin covers rounding ``alpha * delta``)."""


def peak_magnitude(tensors: Mapping[str, torch.Tensor]) -> float:
    """The largest absolute value in ``tensors``: one pass over one buffer for a plain float32 file (``load_flat``),
    else a pass per tensor (420 small calls for a smollm2-135m adapter, several times the cost of one buffer)."""
    flat = load_flat(tensors.path) if isinstance(tensors, FileTensors) else None
    tiled = flat_offsets(list(flat.values())) if flat else None
    values = [torch.from_numpy(tiled[0])] if tiled is not None else [t for _, t in tensors_of(tensors)]
    return max((float(torch.linalg.vector_norm(t, float("inf"))) for t in values if t.numel()), default=0.0)


def headroom(weights: Mapping[str, torch.Tensor]) -> float:
    """How far every value of ``weights`` may move and surely stay finite: ``SAFE_MAGNITUDE`` less their peak
    magnitude (-inf unless they are all float32, whose range the bound is for)."""
    if any(t.dtype != torch.float32 for _, t in tensors_of(weights)):
        return float("-inf")
    return SAFE_MAGNITUDE - peak_magnitude(weights)


def surely_finite(room: float, delta_peak: float, alpha: float) -> bool:
    """Whether ``weights + alpha * delta`` cannot overflow, from the weights' ``headroom`` and the delta's
    ``peak_magnitude``: ``|w + a d| <= max|w| + |a| max|d|``. False proves nothing (the peaks may sit in different
    places): compute the sum (``weights_plus``) and look (``check_step_result``). Trained weights are far from
    float32's range, so a check usually costs one pass over the delta instead of a copy of the weights plus two."""
    return abs(alpha) * delta_peak <= room


def weights_plus(weights: Path | Mapping[str, torch.Tensor],
                 weighted: list[tuple[Mapping[str, torch.Tensor], float]]) -> StateDict:
    """``weights`` (a file, or tensors left as they are) plus ``sum alpha * delta``, in float32 as a step adds them."""
    if isinstance(weights, Path):
        current = load_flat(weights) or load_file(weights)
    else:
        current = {k: v.to(torch.float32, copy=True) for k, v in weights.items()}
    add_deltas(current, weighted)
    return current


def as_clipped(deltas: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Mapping[str, torch.Tensor]:
    """An accepted update's deltas as they are aggregated: times the ``NORM_SCALE`` it was clipped by at receipt."""
    scale = meta.get(NORM_SCALE, 1.0)
    return deltas if scale == 1.0 else {k: t * scale for k, t in tensors_of(deltas)}  # one pass, not per tensor
