"""Norm check: an update far larger than the expert's recent ones is rejected or clipped.

A worker whose update is K times the norm of what honest workers send is broken or hostile
(diverged training, a scaled or sign-flipped attack). The reference is the *median* of the
expert's last ``history`` accepted update norms, so a few bad values in it do not move it,
and it is stored in SQLite (``coordinator.access.audit``), so it survives restarts. Until ``warmup``
norms are known there is nothing to compare with and every update passes.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.errors import InvalidUpdate

NORM_CHECK_MODES = ("off", "reject", "clip")


@dataclass(frozen=True)
class NormPolicy:
    mode: str = "off"
    """off: no check; reject: 422 above the limit; clip: scale the update down to the limit."""
    factor: float = 10.0
    """The limit is factor x the median of recent accepted norms."""
    history: int = 20
    """How many of the expert's newest accepted norms the median is taken over."""
    warmup: int = 5
    """Accepted updates needed before the check applies."""


@dataclass(frozen=True)
class NormVerdict:
    norm: float
    """L2 norm of the decoded update, all tensors together."""
    limit: float | None
    """factor x median of recent norms; None while the check does not apply."""
    history: int
    """How many recent norms the limit was computed from."""
    scale: float = 1.0
    """What the update is multiplied by before it is used (< 1 when clipped)."""

    @property
    def clipped(self) -> bool:
        return self.scale < 1.0

    @property
    def accepted_norm(self) -> float:
        return self.norm * self.scale


def judge_norm(norm: float, recent: Sequence[float], policy: NormPolicy) -> NormVerdict:
    """Compare an update's norm with the recent ones; raises InvalidUpdate (422) in reject mode."""
    recent = [n for n in recent if math.isfinite(n)]  # data dirs from before norms were kept finite
    if policy.mode == "off" or len(recent) < policy.warmup:
        return NormVerdict(norm, None, len(recent))
    reference = statistics.median(recent)
    if reference <= 0:  # only all-zero updates so far: no scale to compare with
        return NormVerdict(norm, None, len(recent))
    limit = policy.factor * reference
    if norm <= limit:
        return NormVerdict(norm, limit, len(recent))
    if policy.mode == "reject":
        raise InvalidUpdate(f"update norm {norm:.4g} is over the limit {limit:.4g} ({policy.factor:g} x the median "
                            f"of this expert's last {len(recent)} accepted update norms); check the worker's "
                            "training, or raise the coordinator's --norm-factor",
                            reason="norm_too_large", norm=norm, limit=limit, history=len(recent))
    return NormVerdict(norm, limit, len(recent), scale=limit / norm)
