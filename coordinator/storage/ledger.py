"""Rows that name no blob (workers, their pulls and routing profiles, the audit log), each durable when written.

``ExpertStore.ledger``: the writes go straight to the manifest and wait for the store's group commit; reads
are ``ExpertStore.rows``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from coordinator.storage.audit_log import Event
from coordinator.storage.blobs import is_storage_full
from coordinator.storage.manifest_roles import EventRows, WorkerRows

log = logging.getLogger(__name__)


class WorkerAndEventRows(WorkerRows, EventRows, Protocol):
    """The two roles the ledger writes (``ManifestBackend`` has both)."""


class Ledger:
    def __init__(self, rows: WorkerAndEventRows, sync: Callable[[], None]) -> None:
        self._rows = rows
        self._sync = sync  # ExpertStore.sync: group commit, then deferred blob deletions

    def add_event(self, event: Event) -> None:
        self._rows.add_event(event)
        self._sync()

    def upsert_worker(self, worker_id: str, specialty: str, base_model: dict[str, Any],
                      sync_interval: float | None, events: tuple[Event, ...] = ()) -> None:
        self._rows.upsert_worker(worker_id, specialty, base_model, sync_interval, events)
        self._sync()

    def touch_worker(self, worker_id: str) -> bool:
        touched = self._rows.touch_worker(worker_id)
        self._sync()
        return touched

    def record_pull(self, worker_id: str, body_bytes: int, raw_bytes: int) -> None:
        """Count a pull; a tally, so a full disk is logged, never raised into the pull it counts."""
        try:
            self._rows.record_pull(worker_id, body_bytes, raw_bytes)
        except Exception as exc:
            if not is_storage_full(exc):
                raise
            log.warning("disk full: pull by %s not counted", worker_id)

    def put_profile(self, expert: str, worker_id: str, vector: bytes, num_examples: int) -> None:
        self._rows.put_profile(expert, worker_id, vector, num_examples)
        self._sync()
