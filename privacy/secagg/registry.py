"""The book an aggregator keeps of its cohorts: which exist, when each round's deadline falls, who is in which.

``SecureAggregator`` runs the protocol's rounds; this keeps what the rounds change in order: every
changed state is journalled before it counts, a new phase gets a new deadline, a finished cohort frees
its members for the next one, and only the newest ``FINISHED_KEPT`` finished cohorts are remembered.
Not thread-safe on its own: the aggregator calls it under its lock.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from privacy.secagg.cohort import CohortState
from privacy.secagg.config import Phase
from privacy.secagg.errors import CohortStateError
from privacy.secagg.journal import CohortJournal
from privacy.secagg.settings import SecAggSettings

log = logging.getLogger(__name__)

FINISHED_KEPT = 64
"""Finished cohorts remembered per aggregator, so late members learn their outcome."""


class CohortRegistry:
    def __init__(self, journal: CohortJournal, settings: SecAggSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.journal, self.settings, self.clock = journal, settings, clock
        self._cohorts: dict[str, CohortState] = {}
        self._deadline: dict[str, float] = {}
        self._assigned: dict[tuple[str, str], str] = {}
        """(expert, worker) -> the unfinished cohort it belongs to: one at a time per worker."""

    def adopt(self, state: CohortState) -> None:
        """Hold ``state`` (new, or resumed from the journal): an unfinished one gets a deadline and its members."""
        self._cohorts[state.config.cohort_id] = state
        if not state.finished:
            self._deadline[state.config.cohort_id] = self._deadline_for(state.phase)
            for member in state.config.members:
                self._assigned[(state.config.expert, member)] = state.config.cohort_id

    def _deadline_for(self, phase: Phase) -> float:
        wait = self.settings.input_timeout if phase is Phase.MASK else self.settings.round_timeout
        return self.clock() + wait

    def get(self, cohort_id: str) -> CohortState:
        state = self._cohorts.get(cohort_id)
        if state is None:
            raise CohortStateError(f"no cohort {cohort_id!r} here (finished long ago, or never formed)")
        return state

    def cohort_of(self, expert: str, worker: str) -> CohortState | None:
        """The unfinished cohort ``worker`` is a member of for ``expert``, if any."""
        cohort_id = self._assigned.get((expert, worker))
        return None if cohort_id is None else self._cohorts[cohort_id]

    def record(self, state: CohortState, before: Phase) -> None:
        """Journal a changed state; a new phase gets a new deadline; a finished cohort frees its members."""
        self.journal.save(state)
        cohort_id = state.config.cohort_id
        if state.phase is not before:
            log.info("cohort %s: %s -> %s %s", cohort_id, before.value, state.phase.value, state.reason)
            self._deadline[cohort_id] = self._deadline_for(state.phase)
        if state.finished:
            self._deadline.pop(cohort_id, None)
            for member in state.config.members:
                if self._assigned.get((state.config.expert, member)) == cohort_id:
                    del self._assigned[(state.config.expert, member)]
            self._prune()

    def _prune(self) -> None:
        finished = [c for c, s in self._cohorts.items() if s.finished]
        for cohort_id in finished[:max(0, len(finished) - FINISHED_KEPT)]:
            del self._cohorts[cohort_id]
            self.journal.remove(cohort_id)

    def overdue(self) -> list[CohortState]:
        """The cohorts whose current round's deadline has passed."""
        now = self.clock()
        return [self._cohorts[c] for c, deadline in list(self._deadline.items()) if now >= deadline]

    def stop_waiting(self, cohort_id: str) -> None:
        """No deadline for this cohort any more (it waits only for the caller to apply it)."""
        del self._deadline[cohort_id]

    def unmaskable(self) -> list[CohortState]:
        return [s for s in self._cohorts.values() if s.can_unmask]

    def listing(self, expert: str | None = None) -> list[dict[str, Any]]:
        """Every known cohort's phase and members (for the dashboard and the tests; no secrets, no inputs)."""
        return [{"cohort_id": c, "expert": s.config.expert, "phase": s.phase.value,
                 "members": list(s.config.members), "inputs": len(s.masked), "reason": s.reason}
                for c, s in self._cohorts.items() if expert is None or s.config.expert == expert]
