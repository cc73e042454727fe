"""The aggregator's side of one cohort: a state machine over Bonawitz et al.'s four rounds.

It holds only what the aggregator may see: public keys, sealed shares it routes but cannot open,
seed commitments, which members sent masked inputs (the inputs themselves live in the journal),
and the survivors' unmasking shares. Each ``close_*`` moves on with the members that answered;
fewer than t at any point abandons the cohort, which applies nothing. The state round-trips
through JSON (``to_record``/``from_record``) so a restarted aggregator resumes the cohort.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from privacy.secagg.config import CohortConfig, Phase
from privacy.secagg.errors import BadSecAggMessage, CohortStateError
from privacy.secagg.member import KEY_SHARE_BYTES, SEED_SHARE_BYTES, PublicKeys, UnmaskAnswer

COMMITMENT_BYTES = 32


@dataclass
class CohortState:
    config: CohortConfig
    phase: Phase = Phase.ADVERTISE
    keys: dict[str, PublicKeys] = field(default_factory=dict)
    sealed: dict[str, dict[str, bytes]] = field(default_factory=dict)
    """sender -> receiver -> sealed share, routed unread."""
    commitments: dict[str, bytes] = field(default_factory=dict)
    masked: dict[str, dict[str, Any]] = field(default_factory=dict)
    """member -> the metadata of its masked input (base version, update id); the vector is journalled."""
    answers: dict[str, UnmaskAnswer] = field(default_factory=dict)
    reason: str = ""
    """Why the cohort was abandoned, for the event log and the members."""

    @property
    def threshold(self) -> int:
        return self.config.threshold

    @property
    def sharers(self) -> set[str]:
        """U2: the members whose shares went out; only their inputs can be unmasked."""
        return set(self.sealed)

    @property
    def survivors(self) -> set[str]:
        return set(self.masked) if self.phase in (Phase.UNMASK, Phase.APPLIED) else set()

    @property
    def dropped(self) -> set[str]:
        return self.sharers - self.survivors if self.phase in (Phase.UNMASK, Phase.APPLIED) else set()

    def _expect(self, phase: Phase, member: str, among: set[str] | tuple[str, ...]) -> None:
        if self.phase is not phase:
            raise CohortStateError(f"cohort {self.config.cohort_id} is in phase {self.phase.value}, "
                                   f"not {phase.value}")
        if member not in among:
            raise BadSecAggMessage(f"{member!r} has no part in phase {phase.value} of cohort {self.config.cohort_id}")

    # Round 0: keys.
    def add_keys(self, member: str, public: PublicKeys) -> None:
        self._expect(Phase.ADVERTISE, member, self.config.members)
        if member in self.keys and self.keys[member] != public:
            raise CohortStateError(f"{member} already advertised other keys in cohort {self.config.cohort_id}")
        self.keys[member] = public
        if len(self.keys) == len(self.config.members):
            self.close_advertise()

    def close_advertise(self) -> None:
        self._close(Phase.ADVERTISE, len(self.keys), Phase.SHARE, "advertised keys")

    # Round 1: sealed shares.
    def add_shares(self, member: str, sealed: dict[str, bytes], commitment: bytes) -> None:
        self._expect(Phase.SHARE, member, set(self.keys))
        if set(sealed) != set(self.keys) - {member}:
            raise BadSecAggMessage(f"{member} must seal one share to each other roster member "
                                   f"({sorted(set(self.keys) - {member})}), got {sorted(sealed)}")
        if len(commitment) != COMMITMENT_BYTES:
            raise BadSecAggMessage(f"a seed commitment is {COMMITMENT_BYTES} bytes, got {len(commitment)}")
        self.sealed[member] = dict(sealed)
        self.commitments[member] = commitment
        if len(self.sealed) == len(self.keys):
            self.close_share()

    def close_share(self) -> None:
        self._close(Phase.SHARE, len(self.sealed), Phase.MASK, "shared keys")

    def shares_for(self, member: str) -> dict[str, bytes]:
        """What ``member`` fetches once the share round closed: the shares U2's other members sealed to it."""
        if self.phase is Phase.SHARE or self.phase is Phase.ADVERTISE or member not in self.sealed:
            raise CohortStateError(f"no shares for {member!r} in cohort {self.config.cohort_id} "
                                   f"(phase {self.phase.value})")
        return {sender: boxes[member] for sender, boxes in self.sealed.items() if sender != member}

    # Round 2: masked inputs, at any time.
    def add_masked(self, member: str, meta: dict[str, Any]) -> bool:
        """Record that ``member``'s masked input is journalled; False if it was already (a retry)."""
        self._expect(Phase.MASK, member, self.sharers)
        if member in self.masked:
            return False
        self.masked[member] = dict(meta)
        if len(self.masked) == len(self.sealed):
            self.close_mask()
        return True

    def close_mask(self) -> None:
        """Survivors are those whose input arrived; the rest are dropped and their masks rebuilt."""
        self._close(Phase.MASK, len(self.masked), Phase.UNMASK, "sent masked inputs")

    # Round 3: unmasking shares.
    def unmask_request(self) -> dict[str, list[str]]:
        if self.phase is not Phase.UNMASK:
            raise CohortStateError(f"cohort {self.config.cohort_id} is not unmasking (phase {self.phase.value})")
        return {"survivors": sorted(self.survivors), "dropped": sorted(self.dropped)}

    def add_answer(self, member: str, answer: UnmaskAnswer) -> None:
        self._expect(Phase.UNMASK, member, self.survivors)
        if set(answer.seed_shares) != self.survivors or set(answer.key_shares) != self.dropped:
            raise BadSecAggMessage(f"{member} must give seed shares of exactly the survivors and key shares "
                                   "of exactly the dropped members")
        if any(len(s) != SEED_SHARE_BYTES for s in answer.seed_shares.values()) or any(
                len(s) != KEY_SHARE_BYTES for s in answer.key_shares.values()):
            raise BadSecAggMessage(f"{member} sent a share of the wrong length")
        self.answers[member] = answer

    @property
    def can_unmask(self) -> bool:
        return self.phase is Phase.UNMASK and len(self.answers) >= self.threshold

    def close_unmask(self) -> None:
        """Give up on a cohort whose survivors stopped answering before t of them did."""
        if not self.can_unmask:
            self.abandon(f"only {len(self.answers)} of {len(self.survivors)} survivors gave unmasking shares; "
                         f"threshold {self.threshold}")

    def mark_applied(self) -> None:
        if not self.can_unmask:
            raise CohortStateError(f"cohort {self.config.cohort_id} cannot be applied in phase {self.phase.value}")
        self.phase = Phase.APPLIED

    def abandon(self, reason: str) -> None:
        if self.phase not in (Phase.APPLIED, Phase.ABANDONED):
            self.phase, self.reason = Phase.ABANDONED, reason

    def _close(self, phase: Phase, answered: int, following: Phase, what: str) -> None:
        if self.phase is not phase:
            return
        if answered < self.threshold:
            self.abandon(f"only {answered} members {what}; threshold {self.threshold}")
        else:
            self.phase = following

    @property
    def finished(self) -> bool:
        return self.phase in (Phase.APPLIED, Phase.ABANDONED)

    def included(self, member: str) -> bool:
        """Whether ``member``'s input is in the applied step (if not, the member re-queues its delta)."""
        return self.phase is Phase.APPLIED and member in self.survivors
