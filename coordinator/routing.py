"""Routing a prompt to the expert whose workers' data it resembles, or to the gateway when unsure.

Workers send a profile of their training prompts when they join (``gateway.router``: hashed character n-gram
counts, no example verbatim); an expert's profile is its workers' combined. ``GET /api/v1/route`` scores a prompt
against every expert's profile (coordinator/api/routes.py).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from coordinator.storage.expert_store import ExpertStore
from gateway.router import combine_profiles, profile_from_json, profile_to_json
from gateway.router import route as route_prompt
from protocol.errors import BadRequest, NotFound
from protocol.schemas import MAX_COUNT, check_name


def route_outcome(expert: str | None, expected: str) -> str:
    """right, wrong_expert or fallback (to the gateway)."""
    return "fallback" if expert is None else "right" if expert == expected else "wrong_expert"


class ExpertRouting:
    """Profiles in the store's rows; ``threshold`` is --route-threshold."""

    def __init__(self, store: ExpertStore, threshold: float) -> None:
        self._store = store
        self.threshold = threshold

    def put_profile(self, name: str, worker_id: str, profile: dict[str, Any]) -> dict[str, Any]:
        """Store one worker's summary of its data (n-gram statistics, no examples) for routing."""
        self._store.require_expert(name)
        check_name(worker_id, "worker_id")
        vector, count = profile_from_json(profile)  # ProfileError: a 400 (coordinator.errors)
        if not 1 <= count <= MAX_COUNT:
            raise BadRequest(f"profile num_examples must be in [1, {MAX_COUNT}], got {count}: "
                             "a profile of no examples cannot route")
        self._store.ledger.put_profile(name, worker_id, vector.astype("<f4").tobytes(), count)
        return {"expert": name, "worker_id": worker_id, "num_examples": count}

    def profiles(self) -> dict[str, Any]:
        """Every expert's combined routing profile (wire form) and the threshold, for routing elsewhere."""
        stored = self._store.rows.profiles()
        profiles = {name: profile_to_json(combine_profiles([(np.frombuffer(v, dtype="<f4"), n) for v, n in rows]),
                                          sum(n for _, n in rows)) for name, rows in stored.items()}
        return {"threshold": self.threshold, "profiles": profiles}

    def route(self, prompt: str, threshold: float | None = None, expected: str | None = None) -> dict[str, Any]:
        """Pick the expert whose data the prompt resembles, or the gateway when unsure.

        ``expected``: the expert the caller knows the prompt belongs to; the answer then says whether the
        route was right, a wrong expert (worse: it can answer below the base model) or a fallback.
        """
        stored = self._store.rows.profiles()
        if not stored:
            raise NotFound("no expert has a routing profile yet (workers send one when they join)")
        profiles = {name: combine_profiles([(np.frombuffer(v, dtype="<f4"), n) for v, n in rows])
                    for name, rows in stored.items()}
        threshold = self.threshold if threshold is None else threshold
        if expected is not None and expected not in profiles:
            raise BadRequest(f"'expected' names no expert with a routing profile: {expected!r}; "
                             f"known: {', '.join(sorted(profiles))}")
        result = route_prompt(prompt, profiles, threshold)  # ProfileError: a 400 (coordinator.errors)
        answer = {"expert": result.expert, "target": result.expert or "gateway", "confidence": result.confidence,
                  "threshold": threshold, "scores": result.scores, "probabilities": result.probabilities}
        if expected is not None:
            answer["outcome"] = route_outcome(result.expert, expected)
        return answer
