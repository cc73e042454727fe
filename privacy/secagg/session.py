"""A worker's secure-aggregation sessions: its part in each cohort, and the delta it still owes.

``CohortSession.advance`` is called whenever the worker has a moment (a background thread polls
it every second or so): it joins the expert's forming cohort, posts keys and sealed shares as the
rounds open, answers the unmasking request, and learns the outcome. ``submit`` sends the masked
input once the interval's delta is ready. The transport is anything with the aggregator's methods:
the HTTP client in the worker, ``SecureAggregator`` itself in tests.

``OwedDelta`` keeps every delta the worker submitted until its cohort applied it with this worker
among the survivors; a delta of an abandoned cohort, or one that arrived too late to count, is
folded into the next submission (nothing trained is lost, and nothing is counted twice).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from privacy.secagg.config import CohortConfig, Phase, b64, unb64
from privacy.secagg.errors import SecAggRefused
from privacy.secagg.member import CohortMember, PublicKeys
from protocol.errors import Conflict

log = logging.getLogger(__name__)


class CohortTransport(Protocol):
    def join(self, expert: str, worker: str) -> dict[str, Any]: ...
    def status(self, cohort_id: str, worker: str) -> dict[str, Any]: ...
    def post_keys(self, cohort_id: str, worker: str, body: Any) -> dict[str, Any]: ...
    def post_shares(self, cohort_id: str, worker: str, body: Any) -> dict[str, Any]: ...
    def shares_for(self, cohort_id: str, worker: str) -> dict[str, Any]: ...
    def post_masked(self, cohort_id: str, worker: str, body: bytes, meta: dict[str, Any]) -> dict[str, Any]: ...
    def post_answer(self, cohort_id: str, worker: str, body: Any) -> dict[str, Any]: ...


class CohortSession:
    """One cohort, from joining to its outcome, for one worker."""

    def __init__(self, transport: CohortTransport, expert: str, worker: str,
                 admit: Callable[[CohortConfig], None] | None = None) -> None:
        self.transport, self.expert, self.worker = transport, expert, worker
        self.admit = admit
        """Called with the cohort's config before this worker takes part; raises (SecAggRefused) to stay out."""
        self.member: CohortMember | None = None
        self.phase = "forming"
        self.submitted = False
        self.outcome: bool | None = None
        """None while the cohort runs; then whether this worker's input is in the applied step."""
        self.reason = ""
        self._keys_sent = self._shared = self._opened = False

    @property
    def cohort_id(self) -> str | None:
        return self.member.config.cohort_id if self.member else None

    @property
    def can_submit(self) -> bool:
        return self._opened and not self.submitted and self.outcome is None

    def advance(self) -> None:
        """Do whatever the cohort's current round asks of this worker (each at most once)."""
        if self.outcome is not None:
            return
        status = (self.transport.status(self.member.config.cohort_id, self.worker) if self.member is not None
                  else self.transport.join(self.expert, self.worker))
        self.phase = status["phase"]
        if self.phase == "forming":
            return
        if self.member is None:  # BadSecAggMessage for a config this worker will not take part in (a DP one without sigma)
            config = CohortConfig.from_json(status["cohort"])
            if self.admit is not None:
                self.admit(config)  # e.g. the worker's --min-dp-noise: refused here, no keys are ever posted
            self.member = CohortMember(config, self.worker)
            dp = self.member.config.dp
            if dp is not None:
                log.info("cohort %s is a DP cohort: this worker clips its update to L2 norm %g and adds Gaussian "
                         "noise of std %g (sigma %g over %d members)", self.cohort_id, dp.clip_norm,
                         dp.share_std(len(self.member.config.members)), dp.noise_multiplier,
                         len(self.member.config.members))
        try:
            self._act(status)
        except Conflict as exc:  # the round closed under us (CohortStateError, a 409): the next status says what happened
            log.info("cohort %s moved on: %s", self.cohort_id, exc.message)

    def _act(self, status: dict[str, Any]) -> None:
        assert self.member is not None
        cohort_id, phase = self.member.config.cohort_id, Phase(status["phase"])
        if phase is Phase.ADVERTISE and not self._keys_sent:
            self._keys_sent = True
            public = self.member.advertisement()
            self.transport.post_keys(cohort_id, self.worker, {"cipher": b64(public.cipher), "mask": b64(public.mask)})
        elif phase is Phase.SHARE and not self._shared and self.worker in status.get("roster", {}):
            roster = {m: PublicKeys(unb64(k["cipher"], "cipher key", 32), unb64(k["mask"], "mask key", 32))
                      for m, k in status["roster"].items()}
            sealed, commitment = self.member.share_keys(roster)
            self._shared = True
            self.transport.post_shares(cohort_id, self.worker, {"sealed": {p: b64(s) for p, s in sealed.items()},
                                                                "commitment": b64(commitment)})
        elif phase is Phase.MASK and self._shared and not self._opened:
            boxes = self.transport.shares_for(cohort_id, self.worker)["sealed"]
            self.member.receive_shares({u: unb64(box, f"share from {u}") for u, box in boxes.items()})
            self._opened = True
        elif phase is Phase.UNMASK and self.submitted and self.member.answered is None:
            request = status["request"]
            answer = self.member.unmask(set(request["survivors"]), set(request["dropped"]))  # may refuse
            self.transport.post_answer(cohort_id, self.worker, {
                "seeds": {u: b64(s) for u, s in answer.seed_shares.items()},
                "keys": {v: b64(s) for v, s in answer.key_shares.items()}})
        elif phase in (Phase.APPLIED, Phase.ABANDONED):
            self.outcome, self.reason = bool(status.get("included")), status.get("reason", "")

    def submit(self, delta: np.ndarray, num_samples: int, meta: dict[str, Any], rounding_seed: int) -> None:
        """Send the masked input of ``delta`` (its shares must be in: ``can_submit``)."""
        if self.member is None or not self.can_submit:
            raise SecAggRefused(f"cohort {self.cohort_id} cannot take this worker's input now (phase {self.phase})")
        vector = self.member.masked_input(delta, num_samples, rounding_seed)
        self.transport.post_masked(self.member.config.cohort_id, self.worker, vector.astype("<u4").tobytes(), meta)
        self.submitted = True


class OwedDelta:
    """Deltas submitted but not yet known to be applied, by cohort; folded into the next submission."""

    def __init__(self) -> None:
        self.in_flight: dict[str, np.ndarray] = {}
        self.carried: np.ndarray | None = None
        """Deltas of cohorts that finished without this worker's input: added to the next submission."""

    def next_delta(self, fresh: np.ndarray) -> np.ndarray:
        """What to submit now: this interval's delta plus every delta still owed."""
        return fresh if self.carried is None else fresh + self.carried

    def submitted(self, cohort_id: str, delta: np.ndarray) -> None:
        self.in_flight[cohort_id] = delta
        self.carried = None

    def settle(self, cohort_id: str, included: bool) -> None:
        delta = self.in_flight.pop(cohort_id, None)
        if delta is not None and not included:
            self.carried = delta if self.carried is None else self.carried + delta
