"""The `auto` model: route each prompt here, with the coordinator's profiles, in well under 1 ms.

The profiles (hashed n-gram statistics of each expert's training prompts, protocol/profiles.py)
are fetched with the other federation state; routing a prompt is then pure numpy on this
machine, with no call to the coordinator on the request path.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol.profiles import ProfileError, profile_from_json
from gateway.router import DEFAULT_THRESHOLD, route

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Routed:
    expert: str | None
    """The expert to answer, or None for the gateway."""
    confidence: float
    seconds: float
    """Time spent routing."""
    probabilities: dict[str, float] = field(default_factory=dict)
    """The router's probability of each available expert (empty when there was nothing to compare)."""


class LocalRouter:
    def __init__(self, threshold: float | None = None) -> None:
        self._lock = threading.Lock()
        self._profiles: dict[str, np.ndarray] = {}
        self._coordinator_threshold = DEFAULT_THRESHOLD
        self._threshold = threshold
        """--route-threshold; None: the coordinator's."""

    @property
    def threshold(self) -> float:
        return self._coordinator_threshold if self._threshold is None else self._threshold

    def update(self, payload: dict[str, Any]) -> None:
        """Take the coordinator's GET /profiles answer; a profile that does not parse is skipped."""
        profiles = {}
        for name, wire in (payload.get("profiles") or {}).items():
            try:
                profiles[name] = profile_from_json(wire)[0]
            except ProfileError as exc:
                log.warning("ignoring the routing profile of %s: %s", name, exc)
        with self._lock:
            self._profiles = profiles
            threshold = payload.get("threshold")
            if isinstance(threshold, (int, float)) and 0 <= threshold <= 1:
                self._coordinator_threshold = float(threshold)

    def experts(self) -> set[str]:
        with self._lock:
            return set(self._profiles)

    def route(self, text: str, available: set[str]) -> Routed:
        """The expert among ``available`` the text resembles, or None (the gateway) below the threshold."""
        started = time.perf_counter()
        with self._lock:
            profiles = {name: p for name, p in self._profiles.items() if name in available}
        if not profiles:
            return Routed(None, 0.0, time.perf_counter() - started)
        result = route(text, profiles, self.threshold)
        probabilities = result.probabilities if result.confidence > 0 else {}
        return Routed(result.expert, result.confidence, time.perf_counter() - started, probabilities)
