"""Fixed-point quantisation of a weighted update into Z_{2^32}, so that masks cancel exactly.

The cohort announces one ``clip`` (bound on each coordinate of a delta), one ``max_weight`` (cap on
a member's sample count) and the ``scale`` derived from them: a member sends
``round(weight * clip(delta) * scale)`` as two's-complement 32-bit integers, then its weight
itself in one more slot. With ``scale`` chosen so that ``K * max_weight * clip * scale < 2^31``,
the sum of K such vectors never wraps, so the coordinator reads the unmasked sum as signed
integers and divides by ``scale``: the weighted sum up to quantisation, exactly as in the clear.

Rounding is stochastic (floor(v + u), u uniform in [0, 1)) with a member-local seed, so it is
unbiased and its error is below one step per coordinate: below 1 / scale in weighted units
(Bonawitz et al. 2017 and Bell et al. 2020 both quantise before masking; the stochastic rounding
follows Kairouz et al., "The Distributed Discrete Gaussian Mechanism", ICML 2021).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from privacy.secagg.errors import BadSecAggMessage
from privacy.secagg.settings import MAX_WEIGHT

MODULUS_BITS = 32
SIGNED_LIMIT = 2 ** (MODULUS_BITS - 1) - 1
"""The largest sum magnitude that decodes unambiguously from Z_{2^32} as a signed integer."""


@dataclass(frozen=True)
class FixedPoint:
    """The quantisation a cohort agrees on, announced with it."""

    clip: float
    """Each coordinate of a delta is clipped to [-clip, clip] before quantisation."""
    max_weight: int
    """A member's weight (its sample count) is capped at this many."""
    members: int
    """K, the number of members whose vectors may be summed."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise BadSecAggMessage(f"clip must be a positive number, got {self.clip!r}")
        if not 1 <= self.max_weight <= MAX_WEIGHT:
            raise BadSecAggMessage(f"max_weight must be in 1..{MAX_WEIGHT}, got {self.max_weight!r}")
        if not 1 <= self.members <= 1024:
            raise BadSecAggMessage(f"a cohort has 1..1024 members, got {self.members!r}")

    @property
    def scale(self) -> float:
        """Integer steps per unit of weighted delta; leaves room for K rounding carries below 2^31."""
        return (SIGNED_LIMIT - self.members) / (self.members * self.max_weight * self.clip)

    def weight_of(self, num_samples: int) -> int:
        """A member's weight: its samples, at least 1, at most ``max_weight``."""
        return max(1, min(int(num_samples), self.max_weight))

    def quantize(self, delta: np.ndarray, weight: int, seed: int) -> np.ndarray:
        """``weight * clip(delta)`` in fixed point, then ``weight``: ``delta.size + 1`` uint32 values."""
        if not 1 <= weight <= self.max_weight:
            raise BadSecAggMessage(f"weight must be in 1..{self.max_weight}, got {weight}")
        flat = np.asarray(delta, dtype=np.float64).reshape(-1)
        if not np.isfinite(flat).all():
            raise BadSecAggMessage("a delta holds NaN or infinite values; refusing to quantise it")
        scaled = np.clip(flat, -self.clip, self.clip)
        scaled *= weight * self.scale
        # float32 noise: its 2^-24 resolution moves a rounding probability by < 1e-7, at half the cost of float64
        scaled += np.random.Generator(np.random.PCG64(seed)).random(flat.size, dtype=np.float32)
        np.floor(scaled, out=scaled)
        out = np.empty(flat.size + 1, dtype=np.uint32)
        # |steps| < 2^31 / K by the choice of scale, so int32 holds them; its bits are the residue mod 2^32
        out[:-1] = scaled.astype(np.int32).view(np.uint32)
        out[-1] = weight
        return out

    def decode_sum(self, total: np.ndarray) -> tuple[np.ndarray, int]:
        """The weighted sum (float64) and the total weight behind an unmasked sum of quantised vectors."""
        if total.dtype != np.uint32 or total.ndim != 1 or total.size < 1:
            raise BadSecAggMessage("an unmasked sum is a flat uint32 vector")
        weight = int(total[-1])
        if not 1 <= weight <= self.members * self.max_weight:
            raise BadSecAggMessage(f"an unmasked sum reports total weight {weight}: masks did not cancel")
        return total[:-1].view(np.int32).astype(np.float64) / self.scale, weight

    def clipped_fraction(self, delta: np.ndarray) -> float:
        """Share of coordinates the clip changes (members log it; a high share means the clip is too tight)."""
        flat = np.asarray(delta).reshape(-1)
        return float(np.mean(np.abs(flat) > self.clip)) if flat.size else 0.0
