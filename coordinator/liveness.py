"""Which registered workers are still training: what ``GET /workers`` shows and what fedasync's alpha counts."""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any


def liveness(silent_for: float, sync_interval: float | None) -> str:
    """alive: heard from within 3 sync intervals (30 s at least); stale: within 20 (5 min); else gone."""
    interval = sync_interval or 10.0
    if silent_for <= max(3 * interval, 30.0):
        return "alive"
    if silent_for <= max(20 * interval, 300.0):
        return "stale"
    return "gone"


def active_workers(workers: Iterable[Mapping[str, Any]], specialty: str, now: float | None = None) -> int:
    """How many registered workers of ``specialty`` are alive (a register, pull or heartbeat within 3 syncs)."""
    now = time.time() if now is None else now
    return sum(1 for w in workers if w["specialty"] == specialty
               and liveness(now - w["last_seen"], w["sync_interval"]) == "alive")
