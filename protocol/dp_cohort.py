"""What a relay's batch says when it is one DP cohort's unmasked sum (``UpdateMeta.dp_cohort``).

Under DP-FedAvg with secure aggregation (docs/privacy.md, "With secure aggregation: distributed noise") each member of
a cohort clips its update to C and adds N(0, sigma^2 C^2 / K) before masking; the aggregator unmasks only the sum.
A relay runs its site's cohorts that way, with the root's sigma and C, and forwards each cohort's sum over K as a
batch of its own. The root books it as one Gaussian step of sensitivity C at sigma sqrt(S / K) (S survivors) and
applies it as it is: nothing is clipped or noised again. This record is how the batch tells the root so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocol.errors import BadRequest

MAX_COHORT_MEMBERS = 1024
"""Far above any --buffer-size a relay runs; a bound on what a header may claim."""


@dataclass(frozen=True)
class DPCohortSum:
    """One secure-aggregation cohort's sum, unmasked by a relay, under the root's DP-FedAvg."""

    cohort: str
    """The cohort's update id at the relay (``secagg-<cohort id>``): the batch's one member, and the key its step is
    booked under at the root (once, across restarts and retries)."""
    members: int
    """K: the cohort's member count, the step's fixed denominator (each member added a 1/K share of the noise)."""
    survivors: int
    """S: members whose inputs are in the sum; the sum's noise multiplier is sigma sqrt(S / K)."""
    noise_multiplier: float
    """sigma, as the cohort config announced it to the members (the root's --dp-noise)."""
    clip_norm: float
    """C, as announced (the root's --dp-clip)."""

    @classmethod
    def from_json(cls, obj: object, where: str) -> DPCohortSum:
        """BadRequest naming the field for anything but what ``to_json`` writes."""
        if not isinstance(obj, dict) or set(obj) != {"cohort", "members", "survivors", "noise_multiplier",
                                                     "clip_norm"}:
            raise BadRequest(f"{where}: dp_cohort must be an object of exactly cohort, members, survivors, "
                             f"noise_multiplier and clip_norm, got {str(obj)[:120]!r}")
        cohort, members, survivors = obj["cohort"], obj["members"], obj["survivors"]
        if not isinstance(cohort, str) or not 1 <= len(cohort) <= 128:
            raise BadRequest(f"{where}: dp_cohort.cohort must be the cohort's update id, got {str(cohort)[:80]!r}")
        if not _count(members) or not 2 <= members <= MAX_COHORT_MEMBERS:
            raise BadRequest(f"{where}: dp_cohort.members must be an integer in 2..{MAX_COHORT_MEMBERS}, "
                             f"got {members!r:.40}")
        if not _count(survivors) or not 1 <= survivors <= members:
            raise BadRequest(f"{where}: dp_cohort.survivors must be an integer in 1..members, got {survivors!r:.40}")
        for name in ("noise_multiplier", "clip_norm"):
            value = obj[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise BadRequest(f"{where}: dp_cohort.{name} must be a finite positive number, got {value!r:.40}")
        return cls(cohort, members, survivors, float(obj["noise_multiplier"]), float(obj["clip_norm"]))

    def to_json(self) -> dict[str, Any]:
        return {"cohort": self.cohort, "members": self.members, "survivors": self.survivors,
                "noise_multiplier": self.noise_multiplier, "clip_norm": self.clip_norm}


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
