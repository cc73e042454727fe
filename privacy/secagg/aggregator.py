"""An aggregator's cohorts (the root's, or a relay's for its site): forming, routing, deadlines, unmasking.

The HTTP layer maps each request to one method here and each method answers JSON-ready dicts, so
the root and a relay share every rule. Cohorts are formed ahead of time: a worker ``join``s the
forming cohort of its expert before its update is ready, the cohort starts when K workers joined,
and its masked inputs may then arrive whenever each worker's interval ends. A phase whose
deadline passes goes on with the members that answered (dropouts), or abandons the cohort below t.

Durability: every state change is journalled before the method returns, and a masked input is
journalled before the state names it (``CohortJournal``), so an acknowledged input survives a kill
and a restarted aggregator resumes each unfinished cohort where it was. A cohort's unmasked sum is
handed out by ``ready`` until the caller confirms it applied it (``applied``), under an update id
derived from the cohort, so a crash between the two applies it once (the store's exactly-once rule).
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from privacy.secagg.cohort import CohortState
from privacy.secagg.config import CohortConfig, Phase, b64, unb64
from privacy.secagg.errors import BadSecAggMessage
from privacy.secagg.journal import CohortJournal
from privacy.secagg.member import PublicKeys, UnmaskAnswer
from privacy.secagg.noise import CohortNoise
from privacy.secagg.quantize import FixedPoint
from privacy.secagg.registry import CohortRegistry
from privacy.secagg.settings import SecAggSettings
from privacy.secagg.unmask import read_masked, unmasked_sum

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CohortSum:
    """An unmasked cohort: the mean delta (flat float64) of its survivors, ready to apply (``_unmask`` says which mean)."""

    config: CohortConfig
    mean: np.ndarray
    weight: int
    members: tuple[str, ...]
    meta: dict[str, dict[str, Any]]
    """Each survivor's input metadata (base version, update id)."""

    @property
    def update_id(self) -> str:
        return cohort_update_id(self.config.cohort_id)


class ReleaseDeferred(Exception):
    """Raised by a ``ready`` release check that cannot answer now (a relay's root unreachable): the cohort keeps its
    masks and is asked about again at the next ``ready``."""


def cohort_update_id(cohort_id: str) -> str:
    """The update id a cohort's step is recorded under (the host's exactly-once key)."""
    return f"secagg-{cohort_id}"


class SecureAggregator:
    """The cohorts of one aggregator; thread-safe (one lock: these are small, fast state changes).

    The rounds' rules live here; which cohorts exist, their deadlines and members are ``registry``'s."""

    def __init__(self, journal: CohortJournal, settings: SecAggSettings, numel_of: Callable[[str], int],
                 clock: Callable[[], float] = time.monotonic, dp: CohortNoise | None = None) -> None:
        """``dp``: every cohort formed is a DP cohort (its members clip and add noise; privacy.secagg.noise)."""
        self.journal, self.settings, self.numel_of, self.dp = journal, settings, numel_of, dp
        self.registry = CohortRegistry(journal, settings, clock)
        self._lock = threading.Lock()
        self._forming: dict[str, list[str]] = {}
        self._deferred: set[str] = set()
        """Cohorts whose release was deferred and not yet retried with success: warned about once, not every tick."""
        for state in journal.load_all():  # resume: deadlines restart from now, which only waits longer
            self.registry.adopt(state)

    def announce_dp(self, dp: CohortNoise | None) -> None:
        """Form every later cohort with ``dp`` (a relay learns its root's sigma and C only when it joins it)."""
        with self._lock:
            self.dp = dp

    # forming ---------------------------------------------------------------------------

    def join(self, expert: str, worker: str) -> dict[str, Any]:
        """Put ``worker`` in its expert's forming cohort (or answer the cohort it already has)."""
        with self._lock:
            state = self.registry.cohort_of(expert, worker)
            if state is not None:
                return self._status(state, worker)
            forming = self._forming.setdefault(expert, [])
            if worker not in forming:
                forming.append(worker)
            if len(forming) < self.settings.cohort_size:
                return {"phase": "forming", "waiting_for": self.settings.cohort_size - len(forming)}
            state = self._form(expert, tuple(forming))
            del self._forming[expert]
            return self._status(state, worker)

    def _form(self, expert: str, members: tuple[str, ...]) -> CohortState:
        config = CohortConfig(cohort_id=f"{expert[:64]}-{secrets.token_hex(8)}", expert=expert, members=members,
                              threshold=self.settings.t, numel=self.numel_of(expert), quant=self._quant(len(members)),
                              dp=self.dp)
        state = CohortState(config)
        self.journal.save(state)
        self.registry.adopt(state)
        log.info("formed cohort %s of %s: %s", config.cohort_id, expert, ", ".join(members))
        return state

    def _quant(self, members: int) -> FixedPoint:
        """The flags' fixed point; a DP cohort's is set by its noise instead: weight 1, range C + 10 noise stds."""
        if self.dp is None:
            return FixedPoint(self.settings.clip, self.settings.max_weight, members)
        return FixedPoint(self.dp.coordinate_bound(members), 1, members)

    def leave(self, expert: str, worker: str) -> None:
        """A worker that stops before its cohort formed leaves the forming list."""
        with self._lock:
            forming = self._forming.get(expert, [])
            if worker in forming:
                forming.remove(worker)

    # the rounds ---------------------------------------------------------------------------

    def status(self, cohort_id: str, worker: str) -> dict[str, Any]:
        with self._lock:
            return self._status(self.registry.get(cohort_id), worker)

    def _status(self, state: CohortState, worker: str) -> dict[str, Any]:
        state.config.index_of(worker)  # only members may look
        out: dict[str, Any] = {"cohort": state.config.to_json(), "phase": state.phase.value}
        if state.phase is not Phase.ADVERTISE and state.keys:
            out["roster"] = {m: {"cipher": b64(k.cipher), "mask": b64(k.mask)} for m, k in state.keys.items()}
        if state.phase is Phase.UNMASK:
            out["request"] = state.unmask_request()
        if state.finished:
            out["included"], out["reason"] = state.included(worker), state.reason
        return out

    def post_keys(self, cohort_id: str, worker: str, body: Any) -> dict[str, Any]:
        public = PublicKeys(cipher=unb64(_field(body, "cipher"), "cipher key", 32),
                            mask=unb64(_field(body, "mask"), "mask key", 32))
        return self._change(cohort_id, worker, lambda s: s.add_keys(worker, public))

    def post_shares(self, cohort_id: str, worker: str, body: Any) -> dict[str, Any]:
        sealed = _field(body, "sealed")
        if not isinstance(sealed, dict):
            raise BadSecAggMessage("sealed must map each peer to its sealed share")
        boxes = {str(peer): unb64(box, f"share for {peer}") for peer, box in sealed.items()}
        commitment = unb64(_field(body, "commitment"), "seed commitment", 32)
        return self._change(cohort_id, worker, lambda s: s.add_shares(worker, boxes, commitment))

    def shares_for(self, cohort_id: str, worker: str) -> dict[str, Any]:
        with self._lock:
            return {"sealed": {u: b64(box) for u, box in self.registry.get(cohort_id).shares_for(worker).items()}}

    def numel_of_cohort(self, cohort_id: str) -> int:
        """The length of a cohort's update vector (a masked input is 4 * (numel + 1) bytes)."""
        with self._lock:
            return self.registry.get(cohort_id).config.numel

    def post_masked(self, cohort_id: str, worker: str, body: bytes, meta: dict[str, Any]) -> dict[str, Any]:
        """Journal a masked input, then record it: only then may the caller answer 202."""
        with self._lock:
            state = self.registry.get(cohort_id)
            vector = read_masked(body, state.config.numel)
            if state.phase is Phase.MASK and worker in state.sharers and worker not in state.masked:
                self.journal.save_masked(state, worker, vector)
            if state.phase is not Phase.MASK and worker in state.masked:
                return self._status(state, worker)  # a retry after the round closed: already recorded
            return self._apply_change(state, worker, lambda s: s.add_masked(worker, meta))

    def post_answer(self, cohort_id: str, worker: str, body: Any) -> dict[str, Any]:
        seeds, keys = _field(body, "seeds"), _field(body, "keys")
        if not isinstance(seeds, dict) or not isinstance(keys, dict):
            raise BadSecAggMessage("an unmasking answer maps members to shares under 'seeds' and 'keys'")
        answer = UnmaskAnswer({str(u): unb64(s, f"seed share of {u}") for u, s in seeds.items()},
                              {str(v): unb64(s, f"key share of {v}") for v, s in keys.items()})
        return self._change(cohort_id, worker, lambda s: s.add_answer(worker, answer))

    def _change(self, cohort_id: str, worker: str, change: Callable[[CohortState], object]) -> dict[str, Any]:
        with self._lock:
            return self._apply_change(self.registry.get(cohort_id), worker, change)

    def _apply_change(self, state: CohortState, worker: str, change: Callable[[CohortState], object]) -> dict[str, Any]:
        before = state.phase
        change(state)
        self.registry.record(state, before)
        return self._status(state, worker)

    # deadlines and results ----------------------------------------------------------------------

    def tick(self) -> None:
        """Close every round whose deadline passed: go on with who answered, or abandon below t."""
        with self._lock:
            for state in self.registry.overdue():
                before = state.phase
                {Phase.ADVERTISE: state.close_advertise, Phase.SHARE: state.close_share,
                 Phase.MASK: state.close_mask, Phase.UNMASK: state.close_unmask}[before]()
                if state.phase is before:  # unmasking with t answers in: nothing left to wait for, only to apply
                    self.registry.stop_waiting(state.config.cohort_id)
                else:
                    self.registry.record(state, before)

    def ready(self, release: Callable[[CohortConfig, int], str | None] | None = None) -> list[CohortSum]:
        """Every cohort whose masks can be removed, unmasked (the caller applies each, then ``applied``).

        ``release(config, survivors)``, if given, is asked before a cohort's masks come off: a reason (str)
        abandons it unopened, ``ReleaseDeferred`` leaves it masked until the next call. With DP, that is where its
        step is booked: a sum seen is privacy spent."""
        with self._lock:
            states = self.registry.unmaskable()
        out = []
        for state in states:
            try:
                refusal = release(state.config, len(state.survivors)) if release is not None else None
            except ReleaseDeferred as exc:  # e.g. the root is unreachable: once per cohort, not every tick of an outage
                cohort = state.config.cohort_id
                (log.debug if cohort in self._deferred else log.warning)(
                    "cohort %s keeps its masks for now: %s", cohort, exc)
                self._deferred.add(cohort)
                continue
            self._deferred.discard(state.config.cohort_id)
            if refusal is None:
                out.append(self._unmask(state))
            else:
                self.abandon(state.config.cohort_id, refusal)
        return out

    def _unmask(self, state: CohortState) -> CohortSum:
        """The survivors' mean: sample-weighted, or in a DP cohort their sum over the cohort's fixed K (DP-FedAvg's
        denominator must not depend on who survived)."""
        total, weight = unmasked_sum(state, lambda member: self.journal.load_masked(state, member))
        survivors = tuple(sorted(state.survivors))
        denominator = weight if state.config.dp is None else len(state.config.members)
        return CohortSum(state.config, total / denominator, weight, survivors,
                         {m: state.masked[m] for m in survivors})

    def applied(self, cohort_id: str) -> None:
        """The caller made the cohort's step durable: mark it, and drop its masked inputs."""
        with self._lock:
            state = self.registry.get(cohort_id)
            if state.phase is Phase.APPLIED:
                return
            before = state.phase
            state.mark_applied()
            self.registry.record(state, before)
            self.journal.forget_inputs(state)

    def abandon(self, cohort_id: str, reason: str) -> None:
        """Give up on a cohort whose step the caller cannot apply (it applies nothing; members re-queue)."""
        with self._lock:
            state = self.registry.get(cohort_id)
            before = state.phase
            state.abandon(reason)
            self.registry.record(state, before)

    def cohorts(self, expert: str | None = None) -> list[dict[str, Any]]:
        """Every known cohort's phase and members (for the dashboard and the tests; no secrets, no inputs)."""
        with self._lock:
            return self.registry.listing(expert)


def _field(body: Any, name: str) -> Any:
    if not isinstance(body, dict) or name not in body:
        raise BadSecAggMessage(f"the request body must be a JSON object with {name!r}")
    return body[name]
