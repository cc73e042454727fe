"""A relay's durable state: queued worker updates, the batches forwarded from them, cached weights.

One SQLite file (``relay.sqlite``, WAL, synchronous=FULL) beside a content-addressed ``BlobStore``.
The invariants, each owned by one method here:

- ``add_update``: a worker's update row is committed after its blob is fsynced; only then is the
  push acknowledged (202). Its row stays after forwarding (blob dropped), so a retry is a 200.
- ``add_batch``: a batch (one combined update per expert, under a deterministic update id made of
  the relay id, the expert and its sequence number), its members and the new error-feedback residual
  are committed in one transaction, after the batch payload's blob is fsynced. A crash before the
  commit leaves the members queued (rebuilt later under the same sequence number, never sent); after
  it, the stored bytes are resent as they are until the root answers, so the root's update-id
  deduplication makes forwarding exactly-once.
- ``batch_done``: a forwarded batch's payload, its members' blobs and the residual it started from
  are dropped, and old forwarded rows are pruned (``prune_forwarded``).
- ``put_cached``: the newest weights of an expert as fetched upstream; the version they replace moves
  to ``cache_history`` (the newest ``keep_previous`` per expert), so a worker's diff pull since a version
  it pulled here is answered here, not over the long link.
- ``supersede_batch``: the root refused a batch because some members reached it another way (a
  worker that failed over to another relay or to the root): the batch is retired, those members are
  marked applied elsewhere, the others queued again, and the residual the batch started from restored.

Pruning keeps what recovery needs: the newest batch row of each expert (its sequence number, so a
restart never reuses a batch id), queued updates and pending batches, and the newest
``keep_forwarded`` forwarded worker-update rows (a worker's quick retry is answered here). An older
retry is queued again and forwarded; the root, which records every member id with its batch,
refuses it (409 with the ids) and the relay drops it: the root is the one place that knows all.
"""
from __future__ import annotations

import contextlib
import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.adapters import stored_deltas
from coordinator.blobs import BlobStore
from coordinator.store import WORKERS_QUERY, touch_worker_row, upsert_worker_row, worker_dicts
from protocol.files import private_file
from protocol.tensors import Manifest

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
    batch INTEGER                 -- seq of the batch that carries it; NULL while queued
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
    status TEXT NOT NULL,         -- pending, forwarded, refused, superseded
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
CREATE TABLE IF NOT EXISTS workers (   -- the root's table (coordinator.store) without its traffic counters
    worker_id TEXT PRIMARY KEY,
    specialty TEXT NOT NULL,
    base_model TEXT NOT NULL,
    registered_at REAL NOT NULL,
    last_seen REAL NOT NULL,
    sync_interval REAL
);
"""


@dataclass(frozen=True)
class QueuedUpdate:
    update_id: str
    expert: str
    meta: dict[str, Any]
    blob: str
    size: int
    body_digest: str
    """Content id of the body as the worker sent it (a batch names its members with it)."""


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


def held_deltas(blobs: BlobStore, held: QueuedUpdate | Batch, manifest: Manifest) -> Mapping[str, Any]:
    """A queued update's or a batch's deltas as the root decodes them, read tensor by tensor from its blob."""
    return stored_deltas(blobs.path(held.blob), held.meta["codec"], held.meta["codec_config"], manifest)


APPLIED_ELSEWHERE = "applied_elsewhere"
"""Status of a worker update the root had already received another way (another relay, or directly)."""
KEEP_FORWARDED = 4096
KEEP_PREVIOUS = 4
"""Versions of each expert kept besides the current one, as bases for workers' diff pulls. A worker's diff
is since the version it last pulled here, one or two versions back when it syncs as often as new versions
come (bench.wan: a sync every ~4 s, a new root version every ~5-10 s); four keep a worker that missed a few
syncs on diffs, for 5 x the weights on disk (49 MB for a smollm2-135m rank-8 adapter)."""


class RelayStore:
    def __init__(self, path: Path, keep_forwarded: int = KEEP_FORWARDED, keep_previous: int = KEEP_PREVIOUS) -> None:
        self.keep_forwarded = keep_forwarded
        self.keep_previous = keep_previous
        self._db = sqlite3.connect(str(private_file(path)), timeout=30, isolation_level=None,
                                   check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(batches)")}
        if "prev_residual" not in columns:  # a data dir from before 0.9
            self._db.execute("ALTER TABLE batches ADD COLUMN prev_residual TEXT")
        self._lock = threading.RLock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _all(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # identity and counters ----------------------------------------------------

    def epoch(self) -> str:
        """Random, made once per data dir: a relay restarted on a fresh data dir never reuses an update id."""
        with self.transaction() as db:
            row = db.execute("SELECT value FROM state WHERE key = 'epoch'").fetchone()
            if row is not None:
                return row[0]
            epoch = secrets.token_hex(4)
            db.execute("INSERT INTO state VALUES ('epoch', ?)", (epoch,))
            return epoch

    def relay_id(self, default: str) -> str:
        """The relay id this data dir was first started with (``default`` then), so a restart keeps it."""
        with self.transaction() as db:
            row = db.execute("SELECT value FROM state WHERE key = 'relay_id'").fetchone()
            if row is not None:
                return row[0]
            db.execute("INSERT INTO state VALUES ('relay_id', ?)", (default,))
            return default

    def stats(self) -> dict[str, int]:
        """Cumulative counters (pruned rows included) for the report to the root."""
        (received, received_bytes), = self._all("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM updates")
        (queued, queued_bytes), = self._all("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM updates WHERE blob IS NOT NULL")
        (batches, forwarded, forwarded_updates), = self._all(
            "SELECT COUNT(*), COALESCE(SUM(size), 0), COALESCE(SUM(members), 0) FROM batches "
            "WHERE status = 'forwarded'")
        pruned = self.counters()
        return {"updates_received": received + pruned.get("updates_received", 0),
                "bytes_received": received_bytes + pruned.get("bytes_received", 0), "queued_updates": queued,
                "queued_bytes": queued_bytes, "batches_forwarded": batches + pruned.get("batches_forwarded", 0),
                "bytes_forwarded": forwarded + pruned.get("bytes_forwarded", 0),
                "updates_forwarded": forwarded_updates + pruned.get("updates_forwarded", 0)}

    def counters(self) -> dict[str, int]:
        return {r[0]: r[1] for r in self._all("SELECT key, value FROM counters")}

    def row_counts(self) -> dict[str, int]:
        """Rows per table (tests: pruning keeps them bounded)."""
        return {t: self._all(f"SELECT COUNT(*) FROM {t}")[0][0] for t in ("updates", "batches")}

    def queued_bytes(self) -> int:
        """Bytes held for forwarding: queued updates and batch payloads not yet delivered."""
        (a,), = self._all("SELECT COALESCE(SUM(size), 0) FROM updates WHERE blob IS NOT NULL AND batch IS NULL")
        (b,), = self._all("SELECT COALESCE(SUM(size), 0) FROM batches WHERE blob IS NOT NULL")
        return a + b

    # worker updates -----------------------------------------------------------

    def update(self, update_id: str) -> dict[str, Any] | None:
        rows = self._all("SELECT u.*, b.status AS batch_status, b.update_id AS batch_id FROM updates u "
                         "LEFT JOIN batches b ON b.expert = u.expert AND b.seq = u.batch WHERE u.update_id = ?",
                         (update_id,))
        return dict(rows[0]) if rows else None

    def add_update(self, expert: str, meta: dict[str, Any], blob: str, size: int) -> None:
        with self.transaction() as db:
            db.execute("INSERT INTO updates VALUES (?, ?, ?, ?, ?, ?, ?, ?, NULL)",
                       (meta["update_id"], expert, meta.get("worker_id"), json.dumps(meta), blob, blob, size,
                        time.time()))

    def queued(self, expert: str) -> list[QueuedUpdate]:
        rows = self._all("SELECT * FROM updates WHERE expert = ? AND batch IS NULL ORDER BY received_at, update_id",
                         (expert,))
        return [QueuedUpdate(r["update_id"], r["expert"], json.loads(r["meta"]), r["blob"], r["size"], r["body_sha256"])
                for r in rows]

    def experts_with_work(self) -> list[str]:
        rows = self._all("SELECT DISTINCT expert FROM updates WHERE batch IS NULL UNION "
                         "SELECT DISTINCT expert FROM batches WHERE status = 'pending' ORDER BY 1")
        return [r[0] for r in rows]

    # batches ------------------------------------------------------------------

    def pending_batch(self, expert: str) -> Batch | None:
        rows = self._all("SELECT * FROM batches WHERE expert = ? AND status = 'pending' ORDER BY seq LIMIT 1",
                         (expert,))
        return None if not rows else _batch(rows[0])

    def next_seq(self, expert: str) -> int:
        (seq,), = self._all("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches WHERE expert = ?", (expert,))
        return seq

    def add_batch(self, batch: Batch, member_ids: list[str], residual_blob: str | None,
                  prev_residual: str | None = None) -> None:
        """Record a batch, claim its members and store the residual, all or nothing. ``prev_residual`` (the
        residual the batch was encoded on) stays referenced until the root answers: ``supersede_batch`` needs it."""
        with self.transaction() as db:
            db.execute("INSERT INTO batches (expert, seq, update_id, meta, blob, size, members, member_bytes, status, "
                       "created_at, prev_residual) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
                       (batch.expert, batch.seq, batch.update_id, json.dumps(batch.meta), batch.blob, batch.size,
                        batch.members, batch.member_bytes, time.time(), prev_residual))
            for update_id in member_ids:
                cur = db.execute("UPDATE updates SET batch = ? WHERE update_id = ? AND batch IS NULL",
                                 (batch.seq, update_id))
                if cur.rowcount != 1:
                    raise RuntimeError(f"update {update_id} was claimed by another batch")
            if residual_blob is None:
                db.execute("DELETE FROM residuals WHERE expert = ?", (batch.expert,))
            else:
                db.execute("INSERT INTO residuals VALUES (?, ?) ON CONFLICT(expert) DO UPDATE SET blob = excluded.blob",
                           (batch.expert, residual_blob))

    def batch_done(self, batch: Batch, status: str) -> list[str]:
        """The root answered for ``batch`` (forwarded, or refused for good): drop its payloads, prune old
        rows. The blobs no longer named here (for the caller to delete if unreferenced)."""
        with self.transaction() as db:
            freed = [r[0] for r in db.execute(
                "SELECT blob FROM updates WHERE expert = ? AND batch = ? AND blob IS NOT NULL UNION "
                "SELECT blob FROM batches WHERE expert = ? AND seq = ? AND blob IS NOT NULL UNION "
                "SELECT prev_residual FROM batches WHERE expert = ? AND seq = ? AND prev_residual IS NOT NULL",
                (batch.expert, batch.seq) * 3).fetchall()]
            db.execute("UPDATE batches SET status = ?, blob = NULL, prev_residual = NULL WHERE expert = ? AND seq = ?",
                       (status, batch.expert, batch.seq))
            db.execute("UPDATE updates SET blob = NULL WHERE expert = ? AND batch = ?", (batch.expert, batch.seq))
            _prune_forwarded(db, self.keep_forwarded)
        return freed

    def supersede_batch(self, batch: Batch, elsewhere: set[str]) -> list[str]:
        """The root already has the members in ``elsewhere``: retire ``batch`` (its id is never sent again),
        mark those members applied elsewhere, queue the others again and restore the residual the batch was
        encoded on. One transaction, so a crash leaves the batch pending (resent, refused again) or retired.
        The blobs no longer named here (for the caller to delete if unreferenced)."""
        with self.transaction() as db:
            row = db.execute("SELECT blob, prev_residual FROM batches WHERE expert = ? AND seq = ?",
                             (batch.expert, batch.seq)).fetchone()
            current = db.execute("SELECT blob FROM residuals WHERE expert = ?", (batch.expert,)).fetchone()
            dropped = db.execute(f"SELECT update_id, blob FROM updates WHERE expert = ? AND batch = ? AND update_id IN "
                                 f"({', '.join('?' * len(elsewhere))})", (batch.expert, batch.seq, *elsewhere)).fetchall()
            freed = [r["blob"] for r in dropped if r["blob"]] + [row["blob"]] + ([current[0]] if current else [])
            db.execute("UPDATE batches SET status = 'superseded', blob = NULL, prev_residual = NULL "
                       "WHERE expert = ? AND seq = ?", (batch.expert, batch.seq))
            db.executemany("UPDATE updates SET blob = NULL WHERE update_id = ?", [(r["update_id"],) for r in dropped])
            db.execute("UPDATE updates SET batch = NULL WHERE expert = ? AND batch = ? AND blob IS NOT NULL",
                       (batch.expert, batch.seq))
            if row["prev_residual"] is None:
                db.execute("DELETE FROM residuals WHERE expert = ?", (batch.expert,))
            else:
                db.execute("INSERT INTO residuals VALUES (?, ?) ON CONFLICT(expert) DO UPDATE SET blob = excluded.blob",
                           (batch.expert, row["prev_residual"]))
        return [b for b in freed if b and b != row["prev_residual"]]

    def residual(self, expert: str) -> str | None:
        rows = self._all("SELECT blob FROM residuals WHERE expert = ?", (expert,))
        return rows[0][0] if rows else None

    def referenced_blobs(self) -> set[str]:
        rows = self._all("SELECT blob FROM updates WHERE blob IS NOT NULL UNION SELECT blob FROM batches WHERE "
                         "blob IS NOT NULL UNION SELECT prev_residual FROM batches WHERE prev_residual IS NOT NULL "
                         "UNION SELECT blob FROM residuals UNION SELECT blob FROM cache UNION SELECT blob FROM cache_history")
        return {r[0] for r in rows}

    # cached weights -----------------------------------------------------------

    def cached(self, expert: str) -> CachedWeights | None:
        rows = self._all("SELECT * FROM cache WHERE expert = ?", (expert,))
        if not rows:
            return None
        r = rows[0]
        return CachedWeights(r["expert"], r["version"], r["etag"], r["blob"], json.loads(r["info"]))

    def cached_experts(self) -> list[CachedWeights]:
        return [CachedWeights(r["expert"], r["version"], r["etag"], r["blob"], json.loads(r["info"]))
                for r in self._all("SELECT * FROM cache ORDER BY expert")]

    def put_cached(self, entry: CachedWeights) -> list[str]:
        """Make ``entry`` the expert's cached weights; the version it replaces joins the history (the newest
        ``keep_previous``). The blobs no longer named by the history (for the caller to delete if unreferenced)."""
        with self.transaction() as db:
            old = db.execute("SELECT version, etag, blob FROM cache WHERE expert = ?", (entry.expert,)).fetchone()
            # versions at or above the new one are not the root's history any more (a root started afresh)
            dropped = [r[0] for r in db.execute("SELECT blob FROM cache_history WHERE expert = ? AND version >= ?",
                                                (entry.expert, entry.version))]
            db.execute("DELETE FROM cache_history WHERE expert = ? AND version >= ?", (entry.expert, entry.version))
            if old is not None and old["version"] < entry.version and self.keep_previous > 0:
                db.execute("INSERT OR REPLACE INTO cache_history VALUES (?, ?, ?, ?)",
                           (entry.expert, old["version"], old["etag"], old["blob"]))
            pruned = db.execute("SELECT version, blob FROM cache_history WHERE expert = ? ORDER BY version DESC "
                                "LIMIT -1 OFFSET ?", (entry.expert, self.keep_previous)).fetchall()
            db.executemany("DELETE FROM cache_history WHERE expert = ? AND version = ?",
                           [(entry.expert, r["version"]) for r in pruned])
            db.execute("INSERT INTO cache VALUES (?, ?, ?, ?, ?) ON CONFLICT(expert) DO UPDATE SET "
                       "version = excluded.version, etag = excluded.etag, blob = excluded.blob, info = excluded.info",
                       (entry.expert, entry.version, entry.etag, entry.blob, json.dumps(entry.info)))
        return dropped + [r["blob"] for r in pruned]

    def cached_version(self, expert: str, version: int) -> CachedWeights | None:
        """Version ``version`` of the expert if the cache holds it (current or in the history), else None."""
        current = self.cached(expert)
        if current is None or current.version == version:
            return current
        rows = self._all("SELECT etag, blob FROM cache_history WHERE expert = ? AND version = ?", (expert, version))
        return CachedWeights(expert, version, rows[0]["etag"], rows[0]["blob"], current.info) if rows else None

    def cached_versions(self, expert: str) -> list[int]:
        """The versions of the expert the cache holds, oldest first."""
        current = self.cached(expert)
        history = [r[0] for r in self._all("SELECT version FROM cache_history WHERE expert = ? ORDER BY version",
                                           (expert,))]
        return history + ([current.version] if current is not None else [])

    # workers ------------------------------------------------------------------

    def upsert_worker(self, worker_id: str, specialty: str, base_model: dict[str, str],
                      sync_interval: float | None) -> None:
        with self.transaction() as db:
            upsert_worker_row(db, worker_id, specialty, base_model, sync_interval)

    def touch_worker(self, worker_id: str) -> bool:
        with self.transaction() as db:
            return touch_worker_row(db, worker_id)

    def workers(self) -> list[dict[str, Any]]:
        return worker_dicts(self._all(WORKERS_QUERY))


def _prune_forwarded(db: sqlite3.Connection, keep: int) -> None:
    """Forget forwarded worker-update rows past the newest ``keep``, then the answered batches no row names
    (each expert's newest batch stays: its sequence number is the next batch id's). Sums go to ``counters``."""
    old = ("SELECT rowid FROM updates WHERE blob IS NULL AND batch IS NOT NULL "
           "ORDER BY received_at DESC, update_id DESC LIMIT -1 OFFSET ?")
    (count, size), = db.execute(f"SELECT COUNT(*), COALESCE(SUM(size), 0) FROM updates WHERE rowid IN ({old})",
                                (keep,)).fetchall()
    if count:
        _count(db, {"updates_received": count, "bytes_received": size})
        db.execute(f"DELETE FROM updates WHERE rowid IN ({old})", (keep,))
    gone = ("SELECT rowid FROM batches b WHERE status != 'pending' "
            "AND seq < (SELECT MAX(seq) FROM batches WHERE expert = b.expert) "
            "AND NOT EXISTS (SELECT 1 FROM updates u WHERE u.expert = b.expert AND u.batch = b.seq)")
    (count, size, members), = db.execute(
        f"SELECT COUNT(*), COALESCE(SUM(size), 0), COALESCE(SUM(members), 0) FROM batches "
        f"WHERE status = 'forwarded' AND rowid IN ({gone})").fetchall()
    if count:
        _count(db, {"batches_forwarded": count, "bytes_forwarded": size, "updates_forwarded": members})
    db.execute(f"DELETE FROM batches WHERE rowid IN ({gone})")


def _count(db: sqlite3.Connection, amounts: dict[str, int]) -> None:
    db.executemany("INSERT INTO counters VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = value + excluded.value",
                   list(amounts.items()))


def _batch(r: sqlite3.Row) -> Batch:
    return Batch(r["expert"], r["seq"], r["update_id"], json.loads(r["meta"]), r["blob"], r["size"], r["members"],
                 r["member_bytes"])
