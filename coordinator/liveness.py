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


def workers_on_expert(workers: Iterable[Mapping[str, Any]], specialty: str, now: float | None = None) -> int:
    """fedasync's N: the registered workers of ``specialty`` not gone (alive or stale: heard from within 20 syncs).

    Not only the alive ones: a worker is heard from when it syncs, and a sync waits for the optimiser step in
    progress, so a worker whose steps take longer than 3 sync intervals (six smollm2 workers sharing 2 cores took
    ~2 minutes a step at 30 s syncs) looked dead between its pushes, N dropped and its next update went in at 1/2 or
    more. Counting too many only makes a step smaller (a worker that finished still counts, for 5 minutes at
    least, so its share of the mean stays 1/N as in FedAvg); counting too few overshoots."""
    now = time.time() if now is None else now
    return sum(1 for w in workers if w["specialty"] == specialty
               and liveness(now - w["last_seen"], w["sync_interval"]) != "gone")
