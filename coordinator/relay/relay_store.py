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
  are dropped, and old forwarded rows are pruned (``prune_forwarded``). A batch of one update the root
  refused for good is dropped with it, and gives back the residual it started from (the root applied none
  of it), with an audit row naming the update.
- ``put_cached``: the newest weights of an expert as fetched upstream; the version they replace moves
  to ``cache_history`` (the newest ``keep_previous`` per expert), so a worker's diff pull since a version
  it pulled here is answered here, not over the long link.
- ``supersede_batch``: the root refused a batch because some members reached it another way (a
  worker that failed over to another relay or to the root): the batch is retired, those members are
  marked applied elsewhere, the others queued again, and the residual the batch started from restored.
- ``split_batch``: the root refused a batch of several updates for its contents (a 422: its step would
  overflow, its norm is over the limit): retired as ``supersede_batch`` retires one, and its members queued
  again in two halves (``split_group``), each sent as a batch of its own under a new id. Bisection: one
  update the root refuses costs its own half, then its quarter, until it alone is refused. The root recorded
  nothing of a refused batch, so its members may go upstream again under any id; a member that reached the
  root another way meanwhile is still caught by the members check (409, ``supersede_batch``).

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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coordinator.checks.adapters import stored_deltas
from coordinator.storage.audit_log import Event, insert_event, insert_norm, query_events, recent_norms
from coordinator.storage.blobs import BlobStore
from coordinator.relay.relay_store_schema import (Batch, CachedWeights, QueuedUpdate, batch_from_row, create_schema,
                                                  prune_forwarded, retire_batch)
from coordinator.storage.manifest_schema import (WORKERS_QUERY, immediate_transaction, touch_worker_row,
                                                 upsert_worker_row, worker_dicts)
from coordinator.checks.update_limits import as_clipped
from protocol.files import private_file
from protocol.tensors import Manifest



def held_deltas(blobs: BlobStore, held: QueuedUpdate | Batch, manifest: Manifest) -> Mapping[str, Any]:
    """A queued update's or a batch's deltas as the root decodes them, read tensor by tensor from its blob (an
    update clipped at receipt, ``--norm-check clip``, scaled as it was)."""
    return as_clipped(stored_deltas(blobs.path(held.blob), held.meta["codec"], held.meta["codec_config"], manifest),
                      held.meta)


APPLIED_ELSEWHERE = "applied_elsewhere"
"""Status of a worker update the root had already received another way (another relay, or directly)."""
KEEP_FORWARDED = 4096
KEEP_PREVIOUS = 4
"""Versions of each expert kept besides the current one, as bases for workers' diff pulls. A worker's diff
is since the version it last pulled here, one or two versions back when it syncs as often as new versions
come (bench.wan: a sync every ~4 s, a new root version every ~5-10 s); four keep a worker that missed a few
syncs on diffs, for 5 x the weights on disk (49 MB for a smollm2-135m rank-8 adapter)."""


class RelayDb:
    """One SQLite connection (``relay.sqlite``, WAL, synchronous=FULL) and the relay's identity and settings."""

    def __init__(self, path: Path, keep_forwarded: int = KEEP_FORWARDED, keep_previous: int = KEEP_PREVIOUS) -> None:
        self.keep_forwarded = keep_forwarded
        self.keep_previous = keep_previous
        self._db = sqlite3.connect(str(private_file(path)), timeout=30, isolation_level=None,
                                   check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        create_schema(self._db)
        self._lock = threading.RLock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def transaction(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return immediate_transaction(self._db, self._lock)

    def _all(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

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

    def setting(self, key: str) -> Any:
        """A JSON value this relay keeps across restarts (e.g. the root's limits, learned when it joined)."""
        rows = self._all("SELECT value FROM state WHERE key = ?", (f"setting.{key}",))
        return json.loads(rows[0][0]) if rows else None

    def put_setting(self, key: str, value: Any) -> None:
        with self.transaction() as db:
            db.execute("INSERT INTO state VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                       (f"setting.{key}", json.dumps(value)))

    def referenced_blobs(self) -> set[str]:
        rows = self._all("SELECT blob FROM updates WHERE blob IS NOT NULL UNION SELECT blob FROM batches WHERE "
                         "blob IS NOT NULL UNION SELECT prev_residual FROM batches WHERE prev_residual IS NOT NULL "
                         "UNION SELECT blob FROM residuals UNION SELECT blob FROM cache UNION SELECT blob FROM cache_history")
        return {r[0] for r in rows}


class QueueTable(RelayDb):
    """Worker updates, queued until a batch carries them upstream (``add_update``)."""

    def update(self, update_id: str) -> dict[str, Any] | None:
        rows = self._all("SELECT u.*, b.status AS batch_status, b.update_id AS batch_id FROM updates u "
                         "LEFT JOIN batches b ON b.expert = u.expert AND b.seq = u.batch WHERE u.update_id = ?",
                         (update_id,))
        return dict(rows[0]) if rows else None

    def add_update(self, expert: str, meta: dict[str, Any], blob: str, size: int, norm: float | None = None,
                   events: tuple[Event, ...] = ()) -> None:
        """Record a worker's update, with its norm (the norm check's history, as at the root) and audit rows."""
        with self.transaction() as db:
            db.execute("INSERT INTO updates (update_id, expert, worker_id, meta, blob, body_sha256, size, received_at) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (meta["update_id"], expert, meta.get("worker_id"),
                                                           json.dumps(meta), blob, blob, size, time.time()))
            if norm is not None:
                insert_norm(db, expert, norm)
            for event in events:
                insert_event(db, event)

    def queued(self, expert: str) -> list[QueuedUpdate]:
        rows = self._all("SELECT * FROM updates WHERE expert = ? AND batch IS NULL ORDER BY received_at, update_id",
                         (expert,))
        return [QueuedUpdate(r["update_id"], r["expert"], json.loads(r["meta"]), r["blob"], r["size"], r["body_sha256"],
                             r["split_group"]) for r in rows]

    def next_members(self, expert: str, limit: int) -> list[QueuedUpdate]:
        """The members of the expert's next batch: the oldest group of a refused batch's halves while there is
        one (bisection: the refusal is narrowed down before anything else joins), else the oldest ``limit``."""
        queued = self.queued(expert)
        groups = [u.split_group for u in queued if u.split_group is not None]
        if groups:
            return [u for u in queued if u.split_group == min(groups)]
        return queued[:limit]

    def has_split_groups(self, expert: str) -> bool:
        """Whether halves of a refused batch of ``expert`` are still queued (``split_batch``)."""
        return bool(self._all("SELECT 1 FROM updates WHERE expert = ? AND batch IS NULL AND split_group IS NOT NULL "
                              "LIMIT 1", (expert,)))

    def worker_of(self, update_id: str) -> str | None:
        rows = self._all("SELECT worker_id FROM updates WHERE update_id = ?", (update_id,))
        return rows[0][0] if rows else None

    def experts_with_work(self) -> list[str]:
        rows = self._all("SELECT DISTINCT expert FROM updates WHERE batch IS NULL UNION "
                         "SELECT DISTINCT expert FROM batches WHERE status = 'pending' ORDER BY 1")
        return [r[0] for r in rows]


class BatchTable(RelayDb):
    """Batches forwarded upstream, their members and error-feedback residuals (``add_batch``, ``batch_done``)."""

    def pending_batch(self, expert: str) -> Batch | None:
        rows = self._all("SELECT * FROM batches WHERE expert = ? AND status = 'pending' ORDER BY seq LIMIT 1",
                         (expert,))
        return None if not rows else batch_from_row(rows[0])

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

    def batch_done(self, batch: Batch, status: str, events: tuple[Event, ...] = ()) -> list[str]:
        """The root answered for ``batch`` (forwarded, or refused for good): drop its payloads, prune old
        rows, add ``events`` to the audit log. A refused batch gives back the residual it was encoded on (the root
        applied none of it: ``retire_batch``); a forwarded one leaves its own. The blobs no longer named here (for
        the caller to delete if unreferenced)."""
        with self.transaction() as db:
            for event in events:
                insert_event(db, event)
            freed = [r[0] for r in db.execute("SELECT blob FROM updates WHERE expert = ? AND batch = ? AND blob IS NOT "
                                              "NULL", (batch.expert, batch.seq)).fetchall()]
            if status == "forwarded":
                freed += [b for b in db.execute("SELECT blob, prev_residual FROM batches WHERE expert = ? AND seq = ?",
                                                (batch.expert, batch.seq)).fetchone() if b]
                db.execute("UPDATE batches SET status = ?, blob = NULL, prev_residual = NULL WHERE expert = ? AND "
                           "seq = ?", (status, batch.expert, batch.seq))
            else:
                freed += retire_batch(db, batch.expert, batch.seq, status)
            db.execute("UPDATE updates SET blob = NULL WHERE expert = ? AND batch = ?", (batch.expert, batch.seq))
            prune_forwarded(db, self.keep_forwarded)
        return freed

    def supersede_batch(self, batch: Batch, elsewhere: set[str]) -> list[str]:
        """The root already has the members in ``elsewhere``: retire ``batch`` (its id is never sent again),
        mark those members applied elsewhere, queue the others again and restore the residual the batch was
        encoded on. One transaction, so a crash leaves the batch pending (resent, refused again) or retired.
        The blobs no longer named here (for the caller to delete if unreferenced)."""
        with self.transaction() as db:
            dropped = db.execute(f"SELECT update_id, blob FROM updates WHERE expert = ? AND batch = ? AND update_id IN "
                                 f"({', '.join('?' * len(elsewhere))})", (batch.expert, batch.seq, *elsewhere)).fetchall()
            db.executemany("UPDATE updates SET blob = NULL WHERE update_id = ?", [(r["update_id"],) for r in dropped])
            freed = retire_batch(db, batch.expert, batch.seq, "superseded")
            db.execute("UPDATE updates SET batch = NULL WHERE expert = ? AND batch = ? AND blob IS NOT NULL",
                       (batch.expert, batch.seq))
        return [r["blob"] for r in dropped if r["blob"]] + freed

    def split_batch(self, batch: Batch) -> list[str]:
        """The root refused ``batch`` (more than one member) for its contents: retire it, restore the residual it
        was encoded on, and queue its members again in two halves (``split_group``), each to go upstream as a
        batch of its own under a new id, so that one bad member costs only its own half. Halves of a half split
        again: bisection, until the member the root refuses is alone (``batch_done(..., "refused")``). One
        transaction, as ``supersede_batch``. The blobs no longer named here."""
        with self.transaction() as db:
            members = [r[0] for r in db.execute("SELECT update_id FROM updates WHERE expert = ? AND batch = ? "
                                                "ORDER BY received_at, update_id", (batch.expert, batch.seq))]
            freed = retire_batch(db, batch.expert, batch.seq, "split")
            half = (len(members) + 1) // 2
            db.executemany("UPDATE updates SET batch = NULL, split_group = ? WHERE update_id = ?",
                           [(2 * batch.seq + (i >= half), update_id) for i, update_id in enumerate(members)])
        return freed

    def residual(self, expert: str) -> str | None:
        rows = self._all("SELECT blob FROM residuals WHERE expert = ?", (expert,))
        return rows[0][0] if rows else None


class CacheTable(RelayDb):
    """The root's weights as fetched, and the versions they replaced (``put_cached``)."""

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


class LogTable(RelayDb):
    """The audit log, the norm history (the root's tables and code, coordinator.access.audit), counters and the relay's workers."""

    def add_event(self, event: Event) -> None:
        with self.transaction() as db:
            insert_event(db, event)

    def events(self, limit: int, after: int | None = None, expert: str | None = None,
               kind: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return query_events(self._db, limit, after, expert, kind)

    def recent_norms(self, expert: str, n: int) -> list[float]:
        with self._lock:
            return recent_norms(self._db, expert, n)

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

    def upsert_worker(self, worker_id: str, specialty: str, base_model: dict[str, str],
                      sync_interval: float | None) -> None:
        with self.transaction() as db:
            upsert_worker_row(db, worker_id, specialty, base_model, sync_interval)

    def touch_worker(self, worker_id: str) -> bool:
        with self.transaction() as db:
            return touch_worker_row(db, worker_id)

    def workers(self) -> list[dict[str, Any]]:
        return worker_dicts(self._all(WORKERS_QUERY))


class RelayStore(QueueTable, BatchTable, CacheTable, LogTable):
    """A relay's durable state (the module docstring says its invariants), one table class per kind of row."""
