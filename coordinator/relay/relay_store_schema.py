"""The relay store's schema (``relay.sqlite``), the records its rows are read into, and the statements several of
its transactions share.

Each function runs inside a transaction of ``coordinator.relay.relay_store.RelayStore``; the invariants they keep are
described there.
"""
from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from coordinator.storage.audit_log import AUDIT_SCHEMA

SCHEMA = """
CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS updates (
    update_id TEXT PRIMARY KEY,
    expert TEXT NOT NULL,
    worker_id TEXT,
    meta TEXT NOT NULL,
    blob TEXT,                    -- NULL once forwarded
    body_sha256 TEXT NOT NULL,    -- a retry must resend the same bytes
    size INTEGER NOT NULL,
    received_at REAL NOT NULL,
    batch INTEGER,                -- seq of the batch that carries it; NULL while queued
    split_group INTEGER           -- a refused batch's half it goes upstream with; NULL: any batch
);
CREATE INDEX IF NOT EXISTS updates_queued ON updates (expert, batch);
CREATE TABLE IF NOT EXISTS batches (
    expert TEXT NOT NULL,
    seq INTEGER NOT NULL,
    update_id TEXT NOT NULL UNIQUE,
    meta TEXT NOT NULL,
    blob TEXT,                    -- NULL once forwarded
    size INTEGER NOT NULL,
    members INTEGER NOT NULL,
    member_bytes INTEGER NOT NULL,
    status TEXT NOT NULL,         -- pending, forwarded, refused, superseded, split
    created_at REAL NOT NULL,
    prev_residual TEXT,           -- the residual it was encoded on top of; NULL once it was answered
    PRIMARY KEY (expert, seq)
);
CREATE TABLE IF NOT EXISTS residuals (expert TEXT PRIMARY KEY, blob TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS counters (key TEXT PRIMARY KEY, value INTEGER NOT NULL);  -- sums of pruned rows
CREATE TABLE IF NOT EXISTS cache (
    expert TEXT PRIMARY KEY,
    version INTEGER NOT NULL,
    etag TEXT NOT NULL,
    blob TEXT NOT NULL,
    info TEXT NOT NULL            -- the root's expert info (spec, counters) as last seen
);
CREATE TABLE IF NOT EXISTS cache_history (  -- versions the cache held before its current one: diff pulls' bases
    expert TEXT NOT NULL,
    version INTEGER NOT NULL,
    etag TEXT NOT NULL,
    blob TEXT NOT NULL,
    PRIMARY KEY (expert, version)
);
CREATE TABLE IF NOT EXISTS workers (   -- the root's table (coordinator.storage.manifest) without its traffic counters
    worker_id TEXT PRIMARY KEY,
    specialty TEXT NOT NULL,
    base_model TEXT NOT NULL,
    registered_at REAL NOT NULL,
    last_seen REAL NOT NULL,
    sync_interval REAL
);
"""

COLUMNS_ADDED = (("batches", "prev_residual TEXT"), ("updates", "split_group INTEGER"))
"""Columns a data dir of an older release lacks (``create_schema`` adds them)."""


def create_schema(db: sqlite3.Connection) -> None:
    """The relay's tables and the audit log's (the root's ``events`` and ``update_norms``), made or brought up to date."""
    db.executescript(SCHEMA + AUDIT_SCHEMA)
    for table, column in COLUMNS_ADDED:
        if column.split()[0] not in {r[1] for r in db.execute(f"PRAGMA table_info({table})")}:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")


def retire_batch(db: sqlite3.Connection, expert: str, seq: int, status: str) -> list[str]:
    """Mark batch ``seq`` of ``expert`` answered without its members having reached the root (``status``:
    superseded, split) and put back the residual it was encoded on. Error feedback: the batch was encoded as
    C(combined + R_old), leaving R_new; the root applied none of it, so R_new (which holds the members' share of
    ``combined``) goes and R_old (the error the root still owes from earlier batches) comes back. The blobs no
    longer named: the batch payload and R_new."""
    row = db.execute("SELECT blob, prev_residual FROM batches WHERE expert = ? AND seq = ?", (expert, seq)).fetchone()
    current = db.execute("SELECT blob FROM residuals WHERE expert = ?", (expert,)).fetchone()
    db.execute("UPDATE batches SET status = ?, blob = NULL, prev_residual = NULL WHERE expert = ? AND seq = ?",
               (status, expert, seq))
    if row["prev_residual"] is None:
        db.execute("DELETE FROM residuals WHERE expert = ?", (expert,))
    else:
        db.execute("INSERT INTO residuals VALUES (?, ?) ON CONFLICT(expert) DO UPDATE SET blob = excluded.blob",
                   (expert, row["prev_residual"]))
    freed = [row["blob"]] + ([current[0]] if current else [])
    return [b for b in freed if b and b != row["prev_residual"]]


def prune_forwarded(db: sqlite3.Connection, keep: int) -> None:
    """Forget forwarded worker-update rows past the newest ``keep``, then the answered batches no row names
    (each expert's newest batch stays: its sequence number is the next batch id's). Sums go to ``counters``."""
    old = ("SELECT rowid FROM updates WHERE blob IS NULL AND batch IS NOT NULL "
           "ORDER BY received_at DESC, update_id DESC LIMIT -1 OFFSET ?")
    (count, size), = db.execute(f"SELECT COUNT(*), COALESCE(SUM(size), 0) FROM updates WHERE rowid IN ({old})",
                                (keep,)).fetchall()
    if count:
        count_pruned(db, {"updates_received": count, "bytes_received": size})
        db.execute(f"DELETE FROM updates WHERE rowid IN ({old})", (keep,))
    gone = ("SELECT rowid FROM batches b WHERE status != 'pending' "
            "AND seq < (SELECT MAX(seq) FROM batches WHERE expert = b.expert) "
            "AND NOT EXISTS (SELECT 1 FROM updates u WHERE u.expert = b.expert AND u.batch = b.seq)")
    (count, size, members), = db.execute(
        f"SELECT COUNT(*), COALESCE(SUM(size), 0), COALESCE(SUM(members), 0) FROM batches "
        f"WHERE status = 'forwarded' AND rowid IN ({gone})").fetchall()
    if count:
        count_pruned(db, {"batches_forwarded": count, "bytes_forwarded": size, "updates_forwarded": members})
    db.execute(f"DELETE FROM batches WHERE rowid IN ({gone})")


def count_pruned(db: sqlite3.Connection, amounts: dict[str, int]) -> None:
    db.executemany("INSERT INTO counters VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = value + excluded.value",
                   list(amounts.items()))


@dataclass(frozen=True)
class QueuedUpdate:
    update_id: str
    expert: str
    meta: dict[str, Any]
    blob: str
    size: int
    body_digest: str
    """Content id of the body as the worker sent it (a batch names its members with it)."""
    split_group: int | None = None
    """Set when a batch carrying it was refused: it goes upstream with the others of this group only."""


@dataclass(frozen=True)
class Batch:
    expert: str
    seq: int
    update_id: str
    meta: dict[str, Any]
    blob: str
    size: int
    members: int
    member_bytes: int


@dataclass(frozen=True)
class CachedWeights:
    expert: str
    version: int
    etag: str
    blob: str
    info: dict[str, Any]


def batch_from_row(r: sqlite3.Row) -> Batch:
    return Batch(r["expert"], r["seq"], r["update_id"], json.loads(r["meta"]), r["blob"], r["size"], r["members"],
                 r["member_bytes"])
