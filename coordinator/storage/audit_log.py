"""The audit log (table ``events``) and the per-expert history of accepted update norms.

Every creation, registration, accepted / duplicate / rejected / clipped update and applied
version becomes one event row: who (worker_id), what (kind, expert, update_id, detail), when
(time) and why (message, detail.reason). ``ManifestStore`` writes an event in the same SQLite
transaction as the change it records; rejections, which change nothing, get a transaction of
their own. The table keeps the newest ``EVENTS_KEPT`` rows, so it cannot grow without bound.

Norm history: the L2 norm of every accepted update, the newest ``NORMS_KEPT`` per expert,
so the norm check (``coordinator.checks.norm_check``) has its reference after a restart too.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from coordinator.storage.sqldb import Connection

log = logging.getLogger(__name__)

AUDIT_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,    -- increasing: clients poll with ?after=ID
    time REAL NOT NULL,
    kind TEXT NOT NULL,              -- expert_created, worker_registered, update_accepted, ...
    expert TEXT,
    worker_id TEXT,
    update_id TEXT,
    message TEXT NOT NULL,           -- one human line
    detail TEXT NOT NULL             -- JSON object
);
CREATE INDEX IF NOT EXISTS events_expert ON events (expert, id);
CREATE INDEX IF NOT EXISTS events_kind ON events (kind, id);
CREATE TABLE IF NOT EXISTS update_norms (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    expert TEXT NOT NULL,
    norm REAL NOT NULL               -- L2 norm of an accepted update, after any clipping
);
CREATE INDEX IF NOT EXISTS update_norms_expert ON update_norms (expert, id);
"""

EVENTS_KEPT = 100_000
"""Rows kept in ``events``; older ones are deleted as new ones arrive."""
NORMS_KEPT = 256
"""Accepted-update norms kept per expert (the upper bound of --norm-history)."""
_TEXT_LIMIT = 200  # worker ids from unparsed headers are attacker-chosen: keep rows small

KINDS = ("expert_created", "worker_registered", "update_accepted", "update_duplicate", "update_rejected",
         "update_clipped", "version_applied", "request_refused", "update_quarantined", "expert_quarantined")


@dataclass(frozen=True)
class Event:
    kind: str
    """One of ``KINDS`` (other branches may add kinds; readers show unknown ones as text)."""
    message: str
    """One human line saying what happened and why."""
    expert: str | None = None
    worker_id: str | None = None
    update_id: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def insert_event(db: Connection, event: Event) -> None:
    """Add one event inside the caller's transaction and drop rows beyond ``EVENTS_KEPT``."""
    cur = db.execute("INSERT INTO events (time, kind, expert, worker_id, update_id, message, detail) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?)",
                     (time.time(), event.kind, _short(event.expert), _short(event.worker_id),
                      _short(event.update_id), _storable(event.message[:1000]),
                      json.dumps(_finite(event.detail), default=str, allow_nan=False)))
    assert cur.lastrowid is not None  # set by the INSERT above
    db.execute("DELETE FROM events WHERE id <= ?", (cur.lastrowid - EVENTS_KEPT,))
    log.debug("%s: %s", event.kind, _storable(event.message))  # every decision, with --debug


def query_events(db: Connection, limit: int, after: int | None = None, expert: str | None = None,
                 kind: str | None = None) -> list[dict[str, Any]]:
    """Newest first, at most ``limit``, optionally only ids above ``after`` / one expert / one kind."""
    where, args = [], []
    for clause, value in (("id > ?", after), ("expert = ?", expert), ("kind = ?", kind)):
        if value is not None:
            where.append(clause)
            args.append(value)
    sql = "SELECT * FROM events" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id DESC LIMIT ?"
    rows = db.execute(sql, (*args, limit)).fetchall()
    return [{"id": r["id"], "time": r["time"], "kind": r["kind"], "expert": r["expert"], "worker_id": r["worker_id"],
             "update_id": r["update_id"], "message": r["message"], "detail": json.loads(r["detail"])} for r in rows]


def insert_norm(db: Connection, expert: str, norm: float) -> None:
    """Remember an accepted update's norm inside the caller's transaction; keep the newest per expert.

    A non-finite norm is never stored: one inf made the median inf, and the check was off for good."""
    if not math.isfinite(norm):
        return
    db.execute("INSERT INTO update_norms (expert, norm) VALUES (?, ?)", (expert, norm))
    db.execute("DELETE FROM update_norms WHERE expert = ? AND id <= (SELECT id FROM update_norms WHERE expert = ? "
               "ORDER BY id DESC LIMIT 1 OFFSET ?)", (expert, expert, NORMS_KEPT))


def recent_norms(db: Connection, expert: str, n: int) -> list[float]:
    """The norms of the expert's newest ``n`` accepted updates, newest first."""
    rows = db.execute("SELECT norm FROM update_norms WHERE expert = ? ORDER BY id DESC LIMIT ?", (expert, n))
    return [r["norm"] for r in rows.fetchall()]


def _finite(value: Any) -> Any:
    """The value with NaN and infinities as None, so every reader can parse the detail as JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _short(text: str | None) -> str | None:
    return None if text is None else _storable(str(text)[:_TEXT_LIMIT])


def _storable(text: str) -> str:
    """``text`` as valid UTF-8: a lone surrogate from a JSON header ("\\ud800") cannot be stored in
    SQLite and would lose the whole row, so it is kept as its escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
