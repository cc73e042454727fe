"""Group commit: writers that finish at about the same time share one flush to disk.

A push used to pay for its own durability: a directory fsync for its blob's rename and an fsync of
SQLite's WAL for its row (``synchronous=FULL``), each ~5 ms on this machine's disk, and the second
one while holding the expert's lock. Now a writer commits without syncing, lets go of its locks,
and calls ``sync()``: the first writer to arrive becomes the leader and runs one flush (every
directory renamed into since the last flush, then the WAL); writers that arrive while it runs wait
for the next flush, which one of them leads. A writer returns only after a flush that *started
after its commit* has finished, so "acknowledged" keeps its meaning: the blob and its row are on
disk before the 202 goes out.
"""
from __future__ import annotations

import threading
from collections.abc import Callable


class GroupCommit:
    """Leader/follower flushing: ``sync()`` returns once everything committed before the call is durable."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush
        self._cond = threading.Condition()
        self._registered = 0  # sync() calls so far (each one's ticket)
        self._durable = 0  # tickets covered by a finished flush
        self._flushing = False
        self.flushes = 0
        """Flushes run so far (``syncs / flushes`` is the group size; exported as a metric)."""
        self.syncs = 0
        """sync() calls so far."""

    def sync(self) -> None:
        """Return once a flush that started after this call has finished (or raise what it raised)."""
        with self._cond:
            self._registered += 1
            self.syncs += 1
            ticket = self._registered
            while self._durable < ticket:
                if self._flushing:
                    self._cond.wait()
                    continue
                self._flushing, target = True, self._registered
                try:
                    self._cond.release()
                    try:
                        self._flush()
                    finally:
                        self._cond.acquire()
                finally:
                    self._flushing = False
                    self._cond.notify_all()  # on failure a waiter leads the next attempt
                self._durable = max(self._durable, target)
                self.flushes += 1
