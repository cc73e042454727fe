"""What ``GET /api/v1/health`` answers: this process is up, and how many experts its store last held.

The answer must come at once whatever the database is doing: a load balancer or an operator asks
/health precisely when something is wrong, and with the manifest in PostgreSQL a table lock held
elsewhere used to hold /health for as long as the lock (it read the expert count on the connection the
locked writes were waiting on). So the count is read on a thread of its own, one read at a time, and
/health waits for it at most ``wait`` seconds; past that (or while an earlier read is still stuck) it
answers the last count read, saying the store is ``slow`` (or ``unavailable`` when the read failed).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

HEALTH_WAIT_S = 0.5


class StoreHealth:
    """The expert count for /health, read without ever waiting more than ``wait`` seconds."""

    def __init__(self, count: Callable[[], int], wait: float = HEALTH_WAIT_S) -> None:
        self._count, self.wait = count, wait
        self._last = 0
        self._state = "ok"
        self._reading: threading.Thread | None = None
        self._guard = threading.Lock()

    def snapshot(self) -> dict[str, Any]:
        """{"experts": count, "store": "ok" | "slow" | "unavailable"}; "ok" means the count was read just now."""
        with self._guard:
            reading = self._reading
            if reading is None:
                done = threading.Event()
                reading = self._reading = threading.Thread(target=self._read, args=(done,), name="fedmoe-health",
                                                           daemon=True)
                reading.start()
            else:
                done = None  # a read still under way from an earlier call: do not queue another behind it
        if done is not None and done.wait(self.wait):
            with self._guard:
                return {"experts": self._last, "store": self._state}
        with self._guard:
            return {"experts": self._last, "store": "slow"}

    def _read(self, done: threading.Event) -> None:
        try:
            count, state = self._count(), "ok"
        except Exception as exc:  # noqa: BLE001 - /health reports it, never raises it
            log.debug("health: the expert count could not be read: %s", exc)
            count, state = None, "unavailable"
        with self._guard:
            if count is not None:
                self._last = count
            self._state = state
            self._reading = None
        done.set()
