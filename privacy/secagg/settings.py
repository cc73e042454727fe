"""Secure aggregation's settings: the flags of the coordinator and the relay (light imports: --help is fast)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from protocol.cli import option

MAX_WEIGHT = 2 ** 20
"""The largest sample count a member's delta may be weighted by (privacy.secagg.quantize.FixedPoint)."""


def minimum_threshold(members: int) -> int:
    """The smallest safe t: a strict majority, so two disjoint survivor sets cannot both reach it."""
    return members // 2 + 1


GROUP = "secure aggregation (--secure-aggregation)"


@dataclass(frozen=True)
class SecAggSettings:
    """How an aggregator forms and times its cohorts (flags of the coordinator and the relay)."""

    cohort_size: int = 4
    """K: workers per cohort (the aggregator's --buffer-size); it learns only the sum of each cohort's inputs."""
    threshold: int = option(0, "t: fewest members a step is made of and whose shares rebuild a mask secret; "
                               "0 = a strict majority of the cohort", flag="--secagg-threshold", group=GROUP)
    clip: float = option(1.0, "each coordinate of a delta is clipped to [-clip, clip] before quantisation to "
                              "integers mod 2^32", flag="--secagg-clip", group=GROUP)
    max_weight: int = option(4096, "a member's sample count, which weights its delta in the cohort's sum, is "
                                   "capped here (with --secagg-clip it sets the quantisation step)",
                             flag="--secagg-max-weight", group=GROUP)
    round_timeout: float = option(60.0, "seconds the key, share and unmasking rounds wait for slow members "
                                        "before going on without them", flag="--secagg-round-timeout", group=GROUP)
    input_timeout: float = option(3600.0, "seconds members may take to send their masked input after the share "
                                          "round (they train meanwhile); later ones count as dropped",
                                  flag="--secagg-input-timeout", group=GROUP)

    def __post_init__(self) -> None:
        if not 2 <= self.cohort_size <= 1024:
            raise ValueError(f"a secure-aggregation cohort (--buffer-size) has 2..1024 workers, got {self.cohort_size}")
        if self.threshold and not minimum_threshold(self.cohort_size) <= self.threshold <= self.cohort_size:
            raise ValueError(f"--secagg-threshold must be in {minimum_threshold(self.cohort_size)}.."
                             f"{self.cohort_size} (a strict majority) or 0, got {self.threshold}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"--secagg-clip must be a positive number, got {self.clip}")
        if not 1 <= self.max_weight <= MAX_WEIGHT:
            raise ValueError(f"--secagg-max-weight must be in 1..{MAX_WEIGHT}, got {self.max_weight}")
        if not (self.round_timeout > 0 and self.input_timeout > 0):
            raise ValueError("secure-aggregation timeouts must be positive")

    @property
    def t(self) -> int:
        return self.threshold or minimum_threshold(self.cohort_size)
