"""Distributed DP noise under secure aggregation: each cohort member adds its share of DP-FedAvg's noise.

With secure aggregation the coordinator never sees one update, so it cannot clip them or add noise
to their sum (DP-FedAvg, McMahan et al. 2018). Each of the K members of a cohort does it instead,
before quantising and masking its input:

    x_u = clip(delta_u, C) + N(0, (sigma C)^2 / K)        so        sum_u x_u = sum_u clip(delta_u, C) + N(0, (sigma C)^2)

(the sum of K independent Gaussians of variance s^2 / K has variance s^2). The coordinator announces
sigma and C in the cohort config; a member never picks its own. If only S of the K members' inputs are
in the sum (dropouts), it carries sigma sqrt(S / K): the coordinator books that smaller multiplier.

Two things a DP cohort fixes that a plain one leaves to the coordinator's flags: every member's weight
is 1 (a sample-count weight would scale a member's influence past C), and the per-coordinate range of
the fixed-point quantisation is C plus ``TAIL_STDS`` noise standard deviations, so the coordinate clip
of ``FixedPoint.quantize`` never changes a noised value in practice: it would be a per-member
non-linearity the sum's Gaussian analysis does not cover. A member refuses a DP cohort that breaks
either (a coordinator could otherwise weaken the noise the member thinks it adds).

This is the "distributed Gaussian" of Truex et al. (2019) and Kairouz, Liu and Steinke ("The Distributed
Discrete Gaussian Mechanism", ICML 2021), with continuous noise rounded stochastically to the cohort's
fixed point rather than their discrete Gaussian; the rounding moves each coordinate by less than one
quantisation step (about 1e-8 of C here), which the accounting ignores, as it ignores floating point.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from privacy.secagg.errors import BadSecAggMessage

TAIL_STDS = 10.0
"""Noise standard deviations past C the quantisation range allows: P(|N(0,1)| > 10) = 1.5e-23 per coordinate."""


@dataclass(frozen=True)
class CohortNoise:
    """DP-FedAvg's settings, as a cohort config carries them to its members (JSON key ``dp``)."""

    noise_multiplier: float
    """sigma: the cohort's sum carries Gaussian noise of standard deviation sigma x C when every member's input is in."""
    clip_norm: float
    """C: each member scales its whole update down to at most this L2 norm before adding its noise."""

    def __post_init__(self) -> None:
        for name in ("noise_multiplier", "clip_norm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                raise BadSecAggMessage(f"a DP cohort's {name} must be a finite positive number, got {value!r}: "
                                       "refusing to join it")

    def share_std(self, members: int) -> float:
        """The standard deviation of each member's noise: sigma C / sqrt(K)."""
        return self.noise_multiplier * self.clip_norm / math.sqrt(members)

    def coordinate_bound(self, members: int) -> float:
        """The quantisation range a DP cohort needs: C (a clipped coordinate's largest value) + TAIL_STDS shares' std."""
        return self.clip_norm + TAIL_STDS * self.share_std(members)

    def privatize(self, delta: np.ndarray, members: int, rng: np.random.Generator) -> np.ndarray:
        """``clip(delta, C) + N(0, (sigma C)^2 / K)`` as float64; ``delta`` is left as it was."""
        flat = np.asarray(delta, dtype=np.float64).reshape(-1)
        norm = float(np.linalg.norm(flat))
        clipped = flat * (self.clip_norm / norm) if norm > self.clip_norm else flat.copy()
        clipped += rng.normal(0.0, self.share_std(members), flat.size)
        return clipped

    def to_json(self) -> dict[str, float]:
        return {"noise_multiplier": self.noise_multiplier, "clip_norm": self.clip_norm}

    @classmethod
    def from_json(cls, body: Any) -> CohortNoise | None:
        """None for a cohort without DP (``dp`` absent or null); a refusal for one whose sigma or C is missing."""
        if body is None:
            return None
        if not isinstance(body, dict):
            raise BadSecAggMessage("a cohort's dp must be an object with noise_multiplier and clip_norm")
        missing = [k for k in ("noise_multiplier", "clip_norm") if k not in body]
        if missing:
            raise BadSecAggMessage(f"a DP cohort config lacks {', '.join(missing)}: a member adds only the noise the "
                                   "coordinator announces, so it refuses to join")
        return cls(noise_multiplier=body["noise_multiplier"], clip_norm=body["clip_norm"])


def noise_rng() -> np.random.Generator:
    """A generator seeded from the operating system's entropy: noise from a guessable seed could be subtracted."""
    return np.random.default_rng()
