"""GET /api/v1/health answers at once, whatever the store is doing (coordinator/storage/health.py).

With the manifest in PostgreSQL, a table lock held elsewhere used to hold /health as long as the lock;
tests/e2e/test_backend_faults.py holds a real one. Here the count function itself is stuck or fails.
"""
from __future__ import annotations

import threading

from coordinator.storage.health import StoreHealth


def test_health_answers_the_last_count_while_the_store_is_held_up():
    release, calls = threading.Event(), []

    def count() -> int:
        calls.append(1)
        if len(calls) == 2:
            release.wait(30)  # a read stuck behind a lock held elsewhere
        if len(calls) == 3:
            raise OSError("down")
        return 4

    health = StoreHealth(count, wait=0.05)
    assert health.snapshot() == {"experts": 4, "store": "ok"}
    assert health.snapshot() == {"experts": 4, "store": "slow"}  # the read is stuck: the last count
    assert health.snapshot() == {"experts": 4, "store": "slow"} and len(calls) == 2  # no second read queued
    stuck = health._reading
    release.set()
    assert stuck is not None
    stuck.join(30)  # the stuck read finishes; the next one fails
    assert health.snapshot() == {"experts": 4, "store": "unavailable"}
