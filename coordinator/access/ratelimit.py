"""Per-worker request rate limit: a token bucket refilled at N per minute, holding at most N.

A worker normally makes a handful of requests per sync interval (push, pull, heartbeat), so the
default of 600 a minute never touches it; a runaway or hostile worker gets 429 with Retry-After
instead of the coordinator's threads. Keys are authenticated worker ids, so the table is bounded
by the number of registered workers, not by what strangers send.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable


class RateLimiter:
    def __init__(self, per_minute: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not per_minute > 0:
            raise ValueError(f"--rate-limit must be > 0 requests per minute, got {per_minute}")
        self.rate = per_minute / 60.0
        self.capacity = max(1.0, per_minute)
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens left, time of last refill)
        self._lock = threading.Lock()

    def acquire(self, key: str) -> float:
        """Take one request from ``key``'s bucket: 0.0 if allowed, else the seconds until it would be."""
        now = self.clock()
        with self._lock:
            tokens, last = self._buckets.get(key, (self.capacity, now))
            tokens = min(self.capacity, tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate
