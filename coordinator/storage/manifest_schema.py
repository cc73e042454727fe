"""The manifest's tables (``SCHEMA``), the records its rows are read into, and the statements the root's
store (coordinator/storage/manifest.py) and a relay's (coordinator/relay/relay_store.py) share: one write
transaction, the worker rows.
"""
from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from coordinator.storage.sqldb import Connection, Row
from protocol.tensors import manifest_from_json

SCHEMA = """
CREATE TABLE IF NOT EXISTS experts (
    name TEXT PRIMARY KEY,
    spec TEXT NOT NULL,              -- ExpertSpec JSON: lora config + base model
    manifest TEXT NOT NULL,          -- [[tensor name, shape], ...]
    version INTEGER NOT NULL,        -- current version
    updates_applied INTEGER NOT NULL DEFAULT 0,
    samples_seen INTEGER NOT NULL DEFAULT 0,
    last_train_loss REAL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS versions (
    expert TEXT NOT NULL,
    version INTEGER NOT NULL,
    blob TEXT,                       -- NULL once pruned (--keep-versions)
    num_updates INTEGER NOT NULL,
    samples INTEGER NOT NULL,
    train_loss REAL,
    created_at REAL NOT NULL,
    PRIMARY KEY (expert, version)
);
CREATE TABLE IF NOT EXISTS updates (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- arrival order
    update_id TEXT NOT NULL UNIQUE,
    expert TEXT NOT NULL,
    worker_id TEXT,
    meta TEXT NOT NULL,              -- UpdateMeta JSON
    blob TEXT,                       -- received payload; NULL once applied
    body_sha256 TEXT,                -- digest of the body as received: a replay must resend the same bytes
    body_bytes INTEGER NOT NULL,
    status TEXT NOT NULL,            -- pending | applied
    applied_version INTEGER,
    received_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS updates_pending ON updates (expert, status, seq);
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT PRIMARY KEY,
    specialty TEXT NOT NULL,
    base_model TEXT NOT NULL,
    registered_at REAL NOT NULL,
    last_seen REAL NOT NULL,
    sync_interval REAL,                        -- seconds, as the worker reported it
    updates_sent INTEGER NOT NULL DEFAULT 0,
    bytes_up INTEGER NOT NULL DEFAULT 0,       -- update bodies as received
    bytes_up_raw INTEGER NOT NULL DEFAULT 0,   -- the same updates as fp32 tensors
    pulls INTEGER NOT NULL DEFAULT 0,
    bytes_down INTEGER NOT NULL DEFAULT 0,     -- weight and diff bodies sent
    bytes_down_raw INTEGER NOT NULL DEFAULT 0  -- the same as fp32 tensors
);
CREATE TABLE IF NOT EXISTS profiles (   -- routing summaries of each worker's data (gateway.router)
    expert TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    vector BLOB NOT NULL,            -- float32 little-endian
    num_examples INTEGER NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (expert, worker_id)
);
CREATE TABLE IF NOT EXISTS gateways (
    version INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,        -- hash of strategy, weights and source versions
    blob TEXT NOT NULL,
    info TEXT NOT NULL,
    created_at REAL NOT NULL
);
"""


@contextmanager
def immediate_transaction(db: Any, lock: threading.RLock) -> Iterator[Any]:
    """A write transaction on the SQLite connection ``db`` under ``lock``: BEGIN IMMEDIATE (the write lock at once,
    not at the first write), COMMIT, or ROLLBACK on any exception. The manifest's and the relay's store both use it."""
    with lock:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")


@dataclass(frozen=True)
class ExpertRow:
    name: str
    spec: dict[str, Any]
    manifest: str
    version: int
    updates_applied: int
    samples_seen: int
    last_train_loss: float | None
    created_at: float
    updated_at: float


@functools.lru_cache(maxsize=256)
def parsed_manifest(text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """An expert's manifest column, parsed once per distinct text (``manifest_from_json``): a push used to
    parse its expert's 336-entry JSON again, a thousand new objects that kept the cyclic GC busy."""
    return tuple(manifest_from_json(text))


@dataclass(frozen=True)
class UpdateRow:
    seq: int
    update_id: str
    expert: str
    worker_id: str | None
    meta: dict[str, Any]
    blob: str | None
    body_sha256: str | None
    body_bytes: int
    status: str
    applied_version: int | None
    received_at: float


def expert_row(row: Row) -> ExpertRow:
    return ExpertRow(name=row["name"], spec=json.loads(row["spec"]), manifest=row["manifest"],
                     version=row["version"], updates_applied=row["updates_applied"],
                     samples_seen=row["samples_seen"], last_train_loss=row["last_train_loss"],
                     created_at=row["created_at"], updated_at=row["updated_at"])


def update_row(row: Row) -> UpdateRow:
    return UpdateRow(seq=row["seq"], update_id=row["update_id"], expert=row["expert"],
                     worker_id=row["worker_id"], meta=json.loads(row["meta"]), blob=row["blob"],
                     body_sha256=row["body_sha256"], body_bytes=row["body_bytes"], status=row["status"],
                     applied_version=row["applied_version"], received_at=row["received_at"])


# worker rows: the root's store and a relay's (coordinator/relay/relay_store.py) keep them with these ------------

WORKERS_QUERY = "SELECT * FROM workers ORDER BY worker_id"


def upsert_worker_row(db: Connection, worker_id: str, specialty: str, base_model: dict[str, Any],
                      sync_interval: float | None) -> None:
    """Register a worker, or renew its row (its traffic counters, where the table has them, are kept)."""
    now = time.time()
    db.execute("INSERT INTO workers (worker_id, specialty, base_model, registered_at, last_seen, "
               "sync_interval) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(worker_id) DO UPDATE SET "
               "specialty = excluded.specialty, base_model = excluded.base_model, "
               "last_seen = excluded.last_seen, sync_interval = excluded.sync_interval",
               (worker_id, specialty, json.dumps(base_model), now, now, sync_interval))


def touch_worker_row(db: Connection, worker_id: str) -> bool:
    """A heartbeat: False if no such worker is registered."""
    return db.execute("UPDATE workers SET last_seen = ? WHERE worker_id = ?", (time.time(), worker_id)).rowcount == 1


def worker_dicts(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Rows of WORKERS_QUERY as the API shows them."""
    return [dict(r) | {"base_model": json.loads(r["base_model"])} for r in rows]
