"""The durable manifest: experts, versions, received updates, workers, gateways.

SQLite in WAL mode. With ``group_commit`` (the coordinator's store) commits do not
sync (``synchronous=NORMAL``); ``flush()`` fsyncs the WAL once for every commit
before it, and checkpoints (copies the WAL into the database) on our schedule
rather than SQLite's (``wal_autocheckpoint=0``), so the WAL is only ever synced
by a flush, after the blob directories it names (coordinator/storage/group_commit.py).
Without it, ``synchronous=FULL``: each commit is durable on return. Tensor data lives in the ``BlobStore``; rows only name blobs by
digest. The order of every write is blob first (fsynced), then the row, so a
row never points at a missing blob; a crash in between leaves an orphan blob
that ``orphan_blobs`` finds at the next start.
"""
from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from coordinator.storage.audit_log import AUDIT_SCHEMA, Event, insert_event, insert_norm, query_events, recent_norms
from coordinator.storage.manifest_schema import (SCHEMA, WORKERS_QUERY, ExpertRow, UpdateRow, expert_row,
                                                 immediate_transaction, touch_worker_row, update_row,
                                                 upsert_worker_row, worker_dicts)
from coordinator.storage.sqldb import Connection, Row
from protocol.errors import Conflict

class StaleAggregation(Exception):
    """The expert moved on, or the updates were applied, since the aggregation read them.

    Only possible when two processes share one data dir (e.g. an orphaned server worker still
    running after its parent was killed): the in-memory per-expert locks do not span processes,
    so the commit itself checks, and the loser's step is dropped rather than applied twice.
    """


CHECKPOINT_WAL_BYTES = 1 << 20
"""With group commit, a flush that finds the WAL larger than this checkpoints it and truncates it (SQLite's
own policy, 1000 pages, let the WAL hold ~4 MiB: enough to fill the 6 MiB disk of tests/coordinator/test_disk_full.py)."""


class SqlManifest:
    """One SQLite connection, serialised by a lock (writes are tiny): what every table of the manifest shares."""

    _wal_fd: int | None = None  # group commit: the WAL file, fsynced by flush()

    def __init__(self, path: Path, group_commit: bool = False) -> None:
        db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        db.row_factory = sqlite3.Row
        self._db: Connection = db
        self._lock = threading.RLock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={'NORMAL' if group_commit else 'FULL'}")
        self._db.executescript(SCHEMA + AUDIT_SCHEMA)
        columns = {r["name"] for r in self._db.execute("PRAGMA table_info(updates)")}
        if "body_sha256" not in columns:  # a data dir made before replays were checked
            self._db.execute("ALTER TABLE updates ADD COLUMN body_sha256 TEXT")
        if group_commit:
            self._db.execute("PRAGMA wal_autocheckpoint=0")
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # what an earlier run left, made durable
            self._wal_fd = os.open(f"{path}-wal", os.O_RDONLY)  # the WAL exists while the connection is open

    def close(self) -> None:
        with self._lock:
            if self._wal_fd is not None:
                with contextlib.suppress(sqlite3.Error):  # e.g. a full disk: the WAL stays, and is read at the next start
                    self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                os.close(self._wal_fd)
                self._wal_fd = None
            self._db.close()

    def flush(self) -> None:
        """Make every commit so far durable (one WAL fsync for all of them); checkpoint a large WAL.
        A no-op without group commit (each commit was synced) and for other backends."""
        fd = self._wal_fd
        if fd is None:
            return
        os.fsync(fd)
        if os.fstat(fd).st_size > CHECKPOINT_WAL_BYTES:
            with self._lock:  # TRUNCATE waits for readers; this connection is the only one
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def held_up(self) -> bool:
        """Whether a lock held elsewhere just cut a statement short (coordinator/storage/backends/postgres.py); SQLite: never."""
        return False

    def transaction(self) -> contextlib.AbstractContextManager[Connection]:
        return immediate_transaction(self._db, self._lock)

    def _all(self, sql: str, *args: Any) -> list[Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _one(self, sql: str, *args: Any) -> Row | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def referenced_blobs(self) -> set[str]:
        rows = self._all("SELECT blob FROM versions WHERE blob IS NOT NULL UNION "
                         "SELECT blob FROM updates WHERE blob IS NOT NULL UNION "
                         "SELECT blob FROM gateways")
        return {r["blob"] for r in rows}


class ExpertTable(SqlManifest):
    """Experts and their versions (``manifest_roles.ExpertRows``)."""

    def create_expert(self, name: str, spec: dict[str, Any], manifest: str, blob: str,
                      events: tuple[Event, ...] = ()) -> None:
        now = time.time()
        with self.transaction() as db:
            db.execute("INSERT INTO experts (name, spec, manifest, version, created_at, updated_at) "
                       "VALUES (?, ?, ?, 0, ?, ?)", (name, json.dumps(spec), manifest, now, now))
            db.execute("INSERT INTO versions VALUES (?, 0, ?, 0, 0, NULL, ?)", (name, blob, now))
            _insert_events(db, events)

    def expert(self, name: str) -> ExpertRow | None:
        row = self._one("SELECT * FROM experts WHERE name = ?", name)
        return expert_row(row) if row else None

    def experts(self) -> list[ExpertRow]:
        return [expert_row(r) for r in self._all("SELECT * FROM experts ORDER BY name")]

    def expert_count(self) -> int:
        """How many experts there are (/health)."""
        row = self._one("SELECT COUNT(*) AS n FROM experts")
        return int(row["n"]) if row else 0

    def version_blob(self, name: str, version: int) -> tuple[bool, str | None]:
        """(exists, blob digest or None if pruned) of one version."""
        row = self._one("SELECT blob FROM versions WHERE expert = ? AND version = ?", name, version)
        return (row is not None, row["blob"] if row else None)

    def versions(self, name: str) -> list[dict[str, Any]]:
        rows = self._all("SELECT version, blob IS NOT NULL AS stored, num_updates, samples, train_loss, "
                         "created_at FROM versions WHERE expert = ? ORDER BY version", name)
        return [dict(r) | {"stored": bool(r["stored"])} for r in rows]

    def commit_version(self, name: str, version: int, blob: str, applied: list[UpdateRow],
                       train_loss: float | None, events: tuple[Event, ...] = ()) -> None:
        """Record a new version and mark the updates it applied, atomically."""
        samples = sum(u.meta["num_samples"] for u in applied)
        now = time.time()
        with self.transaction() as db:
            current = db.execute("SELECT version FROM experts WHERE name = ?", (name,)).fetchone()
            if current is None or current["version"] != version - 1:
                raise StaleAggregation(f"expert {name!r} is no longer at version {version - 1}")
            marked = db.executemany("UPDATE updates SET status = 'applied', applied_version = ?, blob = NULL "
                                    "WHERE seq = ? AND status = 'pending'", [(version, u.seq) for u in applied])
            if marked.rowcount != len(applied):
                raise StaleAggregation(f"some updates of expert {name!r} were applied meanwhile")
            db.execute("INSERT INTO versions VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (name, version, blob, len(applied), samples, train_loss, now))
            db.execute("UPDATE experts SET version = ?, updates_applied = updates_applied + ?, "
                       "samples_seen = samples_seen + ?, last_train_loss = COALESCE(?, last_train_loss), "
                       "updated_at = ? WHERE name = ?",
                       (version, len(applied), samples, train_loss, now, name))
            _insert_events(db, events)

    def prune_versions(self, name: str, keep: int) -> list[str]:
        """Forget the blobs of all but the newest ``keep`` versions; return their digests."""
        with self.transaction() as db:
            rows = db.execute("SELECT version, blob FROM versions WHERE expert = ? AND blob IS NOT NULL "
                              "ORDER BY version DESC LIMIT -1 OFFSET ?", (name, keep)).fetchall()
            db.executemany("UPDATE versions SET blob = NULL WHERE expert = ? AND version = ?",
                           [(name, r["version"]) for r in rows])
        return [r["blob"] for r in rows]

    def remove_expert(self, name: str, events: tuple[Event, ...] = ()) -> None:
        """Forget an expert that cannot be loaded: its versions and profiles go, its pending updates are
        quarantined; update rows stay, so their update_ids are never taken as new."""
        with self.transaction() as db:
            db.execute("UPDATE updates SET status = 'quarantined', blob = NULL WHERE expert = ? AND status = 'pending'",
                       (name,))
            for table in ("versions", "profiles"):
                db.execute(f"DELETE FROM {table} WHERE expert = ?", (name,))
            db.execute("DELETE FROM experts WHERE name = ?", (name,))
            _insert_events(db, events)

    def expert_blobs(self, name: str) -> list[str]:
        """Every blob an expert's rows name: its stored versions and pending updates."""
        rows = self._all("SELECT blob FROM versions WHERE expert = ? AND blob IS NOT NULL UNION "
                         "SELECT blob FROM updates WHERE expert = ? AND blob IS NOT NULL", name, name)
        return [r["blob"] for r in rows]


class UpdateTable(SqlManifest):
    """Received updates and the norms of accepted ones (``manifest_roles.UpdateRows``)."""

    def add_update(self, name: str, meta: dict[str, Any], blob: str, body_bytes: int, raw_bytes: int,
                   norm: float | None = None, events: tuple[Event, ...] = ()) -> UpdateRow:
        """Record a pending update; ``blob`` is the body's SHA-256, kept as ``body_sha256`` after it is applied."""
        with self.transaction() as db:
            db.execute("INSERT INTO updates (update_id, expert, worker_id, meta, blob, body_sha256, body_bytes, "
                       "status, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, 'pending', ?)",
                       (meta["update_id"], name, meta.get("worker_id"), json.dumps(meta), blob, blob,
                        body_bytes, time.time()))
            if meta.get("members"):
                _record_members(db, name, meta["update_id"], meta["members"])
            if meta.get("worker_id"):
                db.execute("UPDATE workers SET updates_sent = updates_sent + 1, bytes_up = bytes_up + ?, "
                           "bytes_up_raw = bytes_up_raw + ?, last_seen = ? WHERE worker_id = ?",
                           (body_bytes, raw_bytes, time.time(), meta["worker_id"]))
            if norm is not None:
                insert_norm(db, name, norm)
            _insert_events(db, events)
        row = self.update(meta["update_id"])
        assert row is not None
        return row

    def update(self, update_id: str) -> UpdateRow | None:
        """The update's row; for a worker update a relay forwarded, status ``relayed`` and ``meta["relayed_in"]``."""
        row = self._one("SELECT * FROM updates WHERE update_id = ?", update_id)
        return update_row(row) if row else None

    def recorded_ids(self, update_ids: list[str]) -> list[str]:
        """Those of ``update_ids`` (at most MAX_BATCH_MEMBERS) recorded here in any way, as update or member."""
        if not update_ids:
            return []
        return [r["update_id"] for r in self._all(_recorded_ids_sql(len(update_ids)), *update_ids)]

    def pending_count(self, name: str) -> int:
        row = self._one("SELECT COUNT(*) AS n FROM updates WHERE expert = ? AND status = 'pending'", name)
        return int(row["n"]) if row else 0

    def pending_updates(self, name: str) -> list[UpdateRow]:
        rows = self._all("SELECT * FROM updates WHERE expert = ? AND status = 'pending' ORDER BY seq", name)
        return [update_row(r) for r in rows]

    def quarantine_updates(self, marked: list[tuple[int, Event]]) -> int:
        """Mark pending updates (seq, with the event saying why) that can never be applied; they keep their
        row (update_id stays used). Updates no longer pending (applied meanwhile) are left alone."""
        count = 0
        with self.transaction() as db:
            for seq, event in marked:
                cur = db.execute("UPDATE updates SET status = 'quarantined', blob = NULL "
                                 "WHERE seq = ? AND status = 'pending'", (seq,))
                if cur.rowcount == 1:
                    insert_event(db, event)
                    count += 1
        return count

    def recent_norms(self, expert: str, n: int) -> list[float]:
        with self._lock:
            return recent_norms(self._db, expert, n)


class WorkerTable(SqlManifest):
    """Workers, their traffic counters and routing profiles (``manifest_roles.WorkerRows``)."""

    def upsert_worker(self, worker_id: str, specialty: str, base_model: dict[str, Any],
                      sync_interval: float | None, events: tuple[Event, ...] = ()) -> None:
        with self.transaction() as db:
            upsert_worker_row(db, worker_id, specialty, base_model, sync_interval)
            _insert_events(db, events)

    def record_pull(self, worker_id: str, body_bytes: int, raw_bytes: int) -> None:
        with self.transaction() as db:
            db.execute("UPDATE workers SET pulls = pulls + 1, bytes_down = bytes_down + ?, "
                       "bytes_down_raw = bytes_down_raw + ?, last_seen = ? WHERE worker_id = ?",
                       (body_bytes, raw_bytes, time.time(), worker_id))

    def touch_worker(self, worker_id: str) -> bool:
        with self.transaction() as db:
            return touch_worker_row(db, worker_id)

    def workers(self) -> list[dict[str, Any]]:
        return worker_dicts(self._all(WORKERS_QUERY))

    def put_profile(self, expert: str, worker_id: str, vector: bytes, num_examples: int) -> None:
        with self.transaction() as db:
            db.execute("INSERT INTO profiles VALUES (?, ?, ?, ?, ?) ON CONFLICT(expert, worker_id) DO UPDATE "
                       "SET vector = excluded.vector, num_examples = excluded.num_examples, "
                       "updated_at = excluded.updated_at", (expert, worker_id, vector, num_examples, time.time()))

    def profiles(self) -> dict[str, list[tuple[bytes, int]]]:
        """Per expert, every worker's (vector bytes, num_examples)."""
        out: dict[str, list[tuple[bytes, int]]] = {}
        for r in self._all("SELECT expert, vector, num_examples FROM profiles ORDER BY expert, worker_id"):
            out.setdefault(r["expert"], []).append((r["vector"], r["num_examples"]))
        return out


class LogTable(SqlManifest):
    """Built gateways and the audit log (``manifest_roles.GatewayRows`` and ``EventRows``)."""

    def gateway(self, key: str | None = None) -> dict[str, Any] | None:
        row = (self._one("SELECT * FROM gateways WHERE key = ?", key) if key
               else self._one("SELECT * FROM gateways ORDER BY version DESC LIMIT 1"))
        if row is None:
            return None
        return {"version": row["version"], "blob": row["blob"], "created_at": row["created_at"],
                **json.loads(row["info"])}

    def add_gateway(self, key: str, blob: str, info: dict[str, Any], keep: int) -> tuple[int, list[str]]:
        """Record a gateway and delete all but the newest ``keep``, in one transaction (a reader never
        sees more than ``keep``); returns its version and the deleted gateways' blob digests."""
        with self.transaction() as db:
            cur = db.execute("INSERT INTO gateways (key, blob, info, created_at) VALUES (?, ?, ?, ?)",
                             (key, blob, json.dumps(info), time.time()))
            rows = db.execute("SELECT version, blob FROM gateways ORDER BY version DESC LIMIT -1 OFFSET ?",
                              (keep,)).fetchall()
            db.executemany("DELETE FROM gateways WHERE version = ?", [(r["version"],) for r in rows])
        assert cur.lastrowid is not None  # set by the INSERT above
        return int(cur.lastrowid), [r["blob"] for r in rows]

    def add_event(self, event: Event) -> None:
        """Record an event that comes with no other change (a rejection, a duplicate)."""
        with self.transaction() as db:
            insert_event(db, event)

    def events(self, limit: int, after: int | None = None, expert: str | None = None,
               kind: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return query_events(self._db, limit, after, expert, kind)


class ManifestStore(ExpertTable, UpdateTable, WorkerTable, LogTable):
    """The durable manifest in SQLite: every role of ``coordinator.storage.manifest_roles`` on one connection.
    ``coordinator.storage.backends.postgres.PostgresManifestStore`` is the same tables on PostgreSQL."""


def _insert_events(db: Connection, events: tuple[Event, ...]) -> None:
    for event in events:
        insert_event(db, event)


RELAYED = "relayed"


def members_applied(batch_id: str, seen: list[str]) -> Conflict:
    """The refusal of a relay batch naming updates this coordinator already recorded (the relay re-sends the rest)."""
    return Conflict(f"batch {batch_id!r} carries {len(seen)} update(s) this coordinator already recorded "
                    f"({', '.join(sorted(seen)[:5])}{', ...' if len(seen) > 5 else ''}); re-send it without them",
                    reason="members_applied", members=sorted(seen), update_id=batch_id)


def _recorded_ids_sql(n: int) -> str:
    return f"SELECT update_id FROM updates WHERE update_id IN ({', '.join('?' * n)})"


def _recorded_ids(db: Connection, ids: list[str]) -> list[str]:
    return [r["update_id"] for r in db.execute(_recorded_ids_sql(len(ids)), ids).fetchall()]


def _record_members(db: Connection, name: str, batch_id: str, members: dict[str, str]) -> None:
    """A relay batch's worker updates get rows of their own (status ``relayed``), in the batch's transaction:
    their ids are then used like any other (a direct push of one is a duplicate). A batch naming an id this
    root has recorded in any way is refused whole, with the ids, so the relay re-sends without them."""
    seen = _recorded_ids(db, list(members))
    if seen:
        raise members_applied(batch_id, seen)
    now = time.time()
    db.executemany("INSERT INTO updates (update_id, expert, worker_id, meta, blob, body_sha256, body_bytes, status, "
                   "received_at) VALUES (?, ?, NULL, ?, NULL, ?, 0, ?, ?)",
                   [(m, name, json.dumps({"update_id": m, "relayed_in": batch_id}), digest, RELAYED, now)
                    for m, digest in members.items()])
