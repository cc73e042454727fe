"""Startup recovery: finish what a crash interrupted, and set aside what can never be used.

Every acknowledged update is applied at the next start (``Coordinator`` re-runs aggregation over
pending rows). But a data dir may hold a blob the loader cannot read or that is not finite: one
written before a check existed (e.g. a safetensors ``__metadata__`` of non-strings, accepted until
the header was checked by the loader itself), or damaged on disk. Refusing to start on it made
one bad push a denial of service for good. Instead such a thing is *quarantined*: a copy is kept
under ``<data dir>/quarantine/<digest>`` for a human, the rows stop naming it, the log says so at
ERROR and the audit log gets an ``update_quarantined`` / ``expert_quarantined`` event.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from coordinator import audit
from coordinator.adapters import check_update
from coordinator.errors import REFUSALS
from coordinator.expert_store import ExpertStore
from coordinator.store import ExpertRow, UpdateRow
from protocol.errors import NotFound
from protocol.streaming import check_file, read_header
from protocol.tensors import manifest_from_json

log = logging.getLogger(__name__)


def recover(store: ExpertStore, aggregate: Callable[[str], None]) -> None:
    """Check each expert and its pending updates, quarantine what is unusable, then ``aggregate`` each."""
    for expert in store.experts():
        problem = expert_problem(store, expert)
        if problem is not None:
            quarantine_expert(store, expert, problem)
            continue
        for update in store.pending_updates(expert.name):
            problem = update_problem(store, expert, update)
            if problem is not None:
                quarantine_updates(store, expert.name, [update], problem)
        aggregate(expert.name)


def expert_problem(store: ExpertStore, expert: ExpertRow) -> str | None:
    """Why the expert's current weights cannot be used (unreadable, other tensors, NaN/Inf), or None."""
    manifest = manifest_from_json(expert.manifest)
    try:
        with store.local_file(store.weights(expert.name).digest) as path:
            if read_header(path).manifest != sorted(manifest):
                return "its weights do not hold the tensors its manifest names"
            check_file(path, manifest)  # chunked: bounded memory; finiteness too
    except REFUSALS + (OSError,) as exc:
        return _reason(exc)
    return None


def update_problem(store: ExpertStore, expert: ExpertRow, update: UpdateRow) -> str | None:
    """Why a pending update cannot be applied to its expert, or None."""
    if update.blob is None:
        return "its payload is missing"
    try:
        with store.local_file(update.blob) as path:
            check_update(path, update.meta["codec"], update.meta.get("codec_config") or {},
                         manifest_from_json(expert.manifest))
    except REFUSALS + (OSError, KeyError) as exc:
        return _reason(exc)
    return None


def quarantine_updates(store: ExpertStore, name: str, updates: list[UpdateRow], reason: str) -> None:
    """Set pending updates aside for good (never applied); keep a copy of their payloads."""
    def event(u: UpdateRow, kept: str | None) -> audit.Event:
        return audit.update_quarantined(name, u.update_id, u.worker_id, reason, kept)

    if store.quarantine_updates(name, updates, reason, event):
        log.error("pending update(s) %s of expert %s quarantined: %s", [u.update_id for u in updates], name, reason)


def quarantine_expert(store: ExpertStore, expert: ExpertRow, reason: str) -> None:
    """Remove an expert whose weights cannot be used; keep copies of all its blobs."""
    kept = store.remove_expert(expert, reason,
                               lambda kept: audit.expert_quarantined(expert.name, expert.version, reason, kept))
    log.error("expert %s quarantined at start: %s; %d blob(s) kept in %s; the next worker of %s creates it again",
              expert.name, reason, len(kept), store.quarantine_location, expert.name)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, NotFound):
        return exc.message
    if isinstance(exc, FileNotFoundError):
        return "its blob is missing"
    return str(getattr(exc, "message", exc))
