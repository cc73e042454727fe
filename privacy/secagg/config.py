"""What a cohort's members and its aggregator agree on before anyone trains: the cohort config.

A cohort is formed ahead of time from registered workers of one expert (K members, threshold t);
its masked inputs may then arrive at any time. The config travels as JSON; binary fields (keys,
shares, commitments) travel as base64 text.
"""
from __future__ import annotations

import base64
import binascii
import enum
import re
from dataclasses import dataclass
from typing import Any

from privacy.secagg.errors import BadSecAggMessage
from privacy.secagg.noise import CohortNoise
from privacy.secagg.quantize import FixedPoint
from privacy.secagg.settings import minimum_threshold

COHORT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""Safe as a file name: the journal keeps one directory per cohort."""


class Phase(str, enum.Enum):
    """Bonawitz et al.'s rounds, as a cohort's phases at the aggregator."""

    ADVERTISE = "advertise"  # members post their two public keys
    SHARE = "share"  # members post their sealed Shamir shares for each peer
    MASK = "mask"  # members post masked inputs, whenever their training interval ends
    UNMASK = "unmask"  # survivors post the shares that remove the masks
    APPLIED = "applied"  # the unmasked sum was applied as one step
    ABANDONED = "abandoned"  # fewer than t members left in some phase: nothing applied


@dataclass(frozen=True)
class CohortConfig:
    """One cohort, as announced to its members."""

    cohort_id: str
    """Unique for the aggregator's lifetime; names the cohort in every derived key."""
    expert: str
    members: tuple[str, ...]
    """Worker ids; a member's Shamir index and mask order is its position here plus one."""
    threshold: int
    """t: the fewest members whose shares rebuild a secret, and the fewest inputs a step is made of."""
    numel: int
    """Length of the flat update (the expert's LoRA tensors in manifest order)."""
    quant: FixedPoint
    dp: CohortNoise | None = None
    """With DP-FedAvg (--dp-noise): the sigma and C every member clips and adds noise by (privacy.secagg.noise)."""

    def __post_init__(self) -> None:
        if not isinstance(self.cohort_id, str) or not COHORT_ID.match(self.cohort_id):
            raise BadSecAggMessage(f"cohort_id must match {COHORT_ID.pattern}, got {self.cohort_id!r}")
        if len(set(self.members)) != len(self.members) or len(self.members) < 2:
            raise BadSecAggMessage(f"a cohort needs 2 or more distinct members, got {list(self.members)}")
        low = minimum_threshold(len(self.members))
        if not low <= self.threshold <= len(self.members):
            raise BadSecAggMessage(f"threshold must be in {low}..{len(self.members)} for "
                                   f"{len(self.members)} members, got {self.threshold}")
        if not isinstance(self.numel, int) or self.numel < 1:
            raise BadSecAggMessage(f"numel must be a positive integer, got {self.numel!r}")
        if self.quant.members != len(self.members):
            raise BadSecAggMessage("the quantisation must be sized for the cohort's members")
        if self.dp is not None:
            self._check_dp(self.dp)

    def _check_dp(self, dp: CohortNoise) -> None:
        """A DP cohort whose quantisation would change a member's noised input is refused (privacy.secagg.noise)."""
        if self.quant.max_weight != 1:
            raise BadSecAggMessage(f"a DP cohort weighs every member 1 (max_weight 1), got {self.quant.max_weight}: "
                                   "a larger weight would scale a member's influence past the clip norm")
        if self.quant.clip < dp.coordinate_bound(len(self.members)):
            raise BadSecAggMessage(f"a DP cohort's quantisation range {self.quant.clip:g} is below "
                                   f"{dp.coordinate_bound(len(self.members)):g}: it would clip members' noise")

    @property
    def context(self) -> bytes:
        """Bound into every derived key and sealed share: keys of one cohort never serve another."""
        return f"{self.expert}/{self.cohort_id}".encode()

    def index_of(self, member: str) -> int:
        try:
            return self.members.index(member) + 1
        except ValueError:
            raise BadSecAggMessage(f"{member!r} is not a member of cohort {self.cohort_id}") from None

    def to_json(self) -> dict[str, Any]:
        return {"cohort_id": self.cohort_id, "expert": self.expert, "members": list(self.members),
                "threshold": self.threshold, "numel": self.numel, "clip": self.quant.clip,
                "max_weight": self.quant.max_weight, "scale": self.quant.scale,
                **({"dp": self.dp.to_json()} if self.dp is not None else {})}

    @classmethod
    def from_json(cls, body: Any) -> CohortConfig:
        if not isinstance(body, dict):
            raise BadSecAggMessage("a cohort config is a JSON object")
        try:
            members = tuple(str(m) for m in body["members"])
            return cls(cohort_id=body["cohort_id"], expert=str(body["expert"]), members=members,
                       threshold=int(body["threshold"]), numel=int(body["numel"]),
                       quant=FixedPoint(clip=float(body["clip"]), max_weight=int(body["max_weight"]),
                                        members=len(members)),
                       dp=CohortNoise.from_json(body.get("dp")))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadSecAggMessage(f"a cohort config is missing or mistypes a field: {exc}") from None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: Any, what: str, size: int | None = None) -> bytes:
    """Strict base64 (no stray characters); ``size`` checks the decoded length."""
    if not isinstance(text, str):
        raise BadSecAggMessage(f"{what} must be base64 text, got {type(text).__name__}")
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise BadSecAggMessage(f"{what} is not valid base64") from None
    if size is not None and len(data) != size:
        raise BadSecAggMessage(f"{what} must be {size} bytes, got {len(data)}")
    return data
