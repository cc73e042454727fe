"""The manifest in PostgreSQL (``--manifest postgresql://...``), so several coordinators share one federation.

The SQL is ManifestStore's own (coordinator/storage/manifest.py, coordinator/storage/audit_log.py): one schema and one set
of queries for both engines, through a thin connection that speaks SQLite's dialect to the store
and PostgreSQL's to the server (``?`` placeholders, ``LIMIT -1``, AUTOINCREMENT, lastrowid).

Serialisation across replicas:
- every write transaction takes one transaction-scoped advisory lock first, exactly what SQLite's
  ``BEGIN IMMEDIATE`` gives one data dir: writes are tiny, so this costs little and keeps every
  read-check-write of the store (commit_version's "still at version v", add_update's status) atomic
  across processes;
- ``expert_lock(name)`` holds a session advisory lock keyed by the expert on a connection of its own
  for as long as an update is checked, recorded and aggregated, so one replica at a time computes a
  step of an expert (a second would only lose at commit, but after wasting the work);
- update ids are UNIQUE: a push recorded by another replica since our check is a duplicate, never a
  second row (the store re-reads and answers it as a retry).

A server that is down or refuses a connection becomes ``BackendUnavailable`` (503 + Retry-After), with
one log line naming the backend; a transaction that fails is rolled back, so nothing is half-recorded.

Every wait is bounded, so a lock held elsewhere (an operator's ``LOCK TABLE``, a stuck session) is a
503 within seconds rather than a request that hangs for as long as the lock is held (a 15 s table
lock used to hold every push for up to 15 s, and /health with them): each session runs with
``lock_timeout`` (LOCK_TIMEOUT_S) and ``statement_timeout`` (STATEMENT_TIMEOUT_S) unless its URL sets
them itself (``?options=-c%20lock_timeout%3D10s``), the one connection a replica shares between its
request threads is waited for at most CONNECTION_WAIT_S, and an expert's lock at most EXPERT_LOCK_WAIT_S.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg.rows import dict_row

from coordinator.storage.audit_log import AUDIT_SCHEMA
from coordinator.storage.backends.errors import BackendUnavailable, log_outage
from coordinator.storage.sqldb import Row
from coordinator.storage.manifest import ManifestStore
from coordinator.storage.manifest_schema import SCHEMA
from protocol.errors import Conflict

log = logging.getLogger(__name__)

WRITE_LOCK = 0x0FED_0E  # the advisory lock every write transaction takes (the "database write lock")
LOCK_TIMEOUT_S = 5.0
"""A statement waiting this long for a lock (table, row, advisory) is cancelled: 503, nothing recorded."""
STATEMENT_TIMEOUT_S = 30.0
"""A statement running this long is cancelled (the store's statements take milliseconds)."""
CONNECTION_WAIT_S = LOCK_TIMEOUT_S
"""A request thread waits this long for the replica's connection while another thread's statement holds it."""
EXPERT_LOCK_WAIT_S = 60.0
"""A push waits this long for its expert's lock (another replica's aggregation step holds it while it computes)."""
_ID_COLUMNS = {"events": "id", "update_norms": "id", "updates": "seq", "gateways": "version"}
_INSERT_TABLE = re.compile(r"^\s*INSERT INTO (\w+)", re.I)


def pg_schema(sqlite_schema: str) -> str:
    """ManifestStore's SQLite schema in PostgreSQL types (comments dropped: some hold semicolons)."""
    s = re.sub(r"--[^\n]*", "", sqlite_schema)
    s = re.sub(r"INTEGER PRIMARY KEY AUTOINCREMENT", "BIGSERIAL PRIMARY KEY", s)
    s = re.sub(r"\bINTEGER\b", "BIGINT", s)
    s = re.sub(r"\bREAL\b", "DOUBLE PRECISION", s)
    return re.sub(r"\bBLOB\b", "BYTEA", s)


def pg_sql(sql: str) -> str:
    """One statement of the stores' SQLite dialect in PostgreSQL's."""
    sql = sql.replace("%", "%%").replace("?", "%s")
    if sql.lstrip().upper().startswith("INSERT OR IGNORE INTO"):
        sql = sql.replace("INSERT OR IGNORE INTO", "INSERT INTO", 1) + " ON CONFLICT DO NOTHING"
    return sql.replace("LIMIT -1 OFFSET", "OFFSET")


class PgCursor:
    """What the store reads from a cursor: rows by column name, rowcount, lastrowid.

    Rows are what the connection's row factory makes: dicts (the manifest), tuples (the tokens)."""

    def __init__(self, cursor: psycopg.Cursor[Any], lastrowid: int | None = None) -> None:
        self._cursor, self.lastrowid = cursor, lastrowid
        self.rowcount = cursor.rowcount

    def fetchone(self) -> Any:
        return self._cursor.fetchone()

    def fetchall(self) -> list[Any]:
        return self._cursor.fetchall()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._cursor.fetchall())


class PgConnection:
    """A psycopg connection that takes the store's SQLite-dialect statements."""

    def __init__(self, url: str, rows: Any = dict_row) -> None:
        self.url = url
        self._conn = _connect(url, rows)

    def executescript(self, script: str) -> None:
        for statement in pg_schema(script).split(";"):
            if statement.strip():
                self._conn.execute(statement)

    def execute(self, sql: str, args: tuple | list = ()) -> PgCursor:
        text = sql.strip()
        if text.upper().startswith("PRAGMA"):
            raise NotImplementedError("PRAGMA is SQLite's")
        if text.upper() == "BEGIN IMMEDIATE":
            self._conn.execute("BEGIN")
            self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK,))
            return PgCursor(self._conn.cursor())
        table = _INSERT_TABLE.match(text)
        column = _ID_COLUMNS.get(table.group(1).lower()) if table else None
        statement = pg_sql(text) + (f" RETURNING {column}" if column else "")
        cursor = self._conn.execute(statement, tuple(args))
        lastrowid = None
        if column:
            row = cursor.fetchone()
            assert row is not None  # INSERT ... RETURNING gives the new row
            lastrowid = row[column]
        return PgCursor(cursor, lastrowid)

    def executemany(self, sql: str, rows: list[tuple]) -> PgCursor:
        cursor = self._conn.cursor()
        total = 0
        for row in rows:  # psycopg's executemany would report only the last statement's rowcount
            cursor.execute(pg_sql(sql), tuple(row))
            total += max(0, cursor.rowcount)
        wrapped = PgCursor(cursor)
        wrapped.rowcount = total
        return wrapped

    def close(self) -> None:
        self._conn.close()


def _connect(url: str, rows: Any = dict_row, lock_timeout: float = LOCK_TIMEOUT_S) -> psycopg.Connection[Any]:
    """A session whose lock waits and statements are bounded (unless ``url`` sets its own bounds)."""
    try:
        conn = psycopg.connect(url, autocommit=True, row_factory=rows, connect_timeout=10)
        bounds = [(name, f"{int(seconds * 1000)}ms") for name, seconds in
                  (("lock_timeout", lock_timeout), ("statement_timeout", STATEMENT_TIMEOUT_S)) if name not in url]
        if bounds:  # one round trip (ExpertLocks connects once per push)
            conn.execute("SELECT " + ", ".join("set_config(%s, %s, false)" for _ in bounds),
                         [value for pair in bounds for value in pair])
        return conn
    except psycopg.OperationalError as exc:
        raise unavailable(url, exc) from None


def busy(url: str, exc: Exception) -> BackendUnavailable:
    """A lock wait or a statement cancelled by its bound: the database answers, something holds it up."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    log_outage(log, url + "#busy", "manifest backend PostgreSQL %s busy: %s", re.sub(r"//[^@/]*@", "//", url), first)
    return BackendUnavailable(f"the coordinator's database (PostgreSQL) is busy ({first}: a lock is held elsewhere "
                              "for longer than this coordinator waits); nothing was recorded, try again",
                              backend="postgresql")


class BoundedLock:
    """The replica's connection lock (re-entrant), waited for at most ``timeout`` seconds, then a 503."""

    def __init__(self, url: str, timeout: float) -> None:
        self._lock = threading.RLock()
        self.url, self.timeout = url, timeout

    def __enter__(self) -> None:
        if not self._lock.acquire(timeout=self.timeout):
            log_outage(log, self.url + "#busy", "manifest backend PostgreSQL: the connection was busy for over %.0f s",
                       self.timeout)
            raise BackendUnavailable(f"the coordinator's database connection has been busy for over "
                                     f"{self.timeout:.0f} s (a lock held elsewhere?); nothing was recorded, try again",
                                     backend="postgresql")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def unavailable(url: str, exc: Exception) -> BackendUnavailable:
    where = re.sub(r"//[^@/]*@", "//", url)  # never log a password
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    log_outage(log, url, "manifest backend PostgreSQL %s failed: %s", where, first)
    return BackendUnavailable(f"the coordinator's database (PostgreSQL) is not answering ({first}); "
                              "nothing was recorded, try again", backend="postgresql")


class PostgresManifestStore(ManifestStore):
    """ManifestStore over PostgreSQL: same queries, one connection serialised by a lock (writes are tiny)."""

    def __init__(self, url: str) -> None:  # not super().__init__: that opens SQLite
        self.url = url
        self._lock = BoundedLock(url, CONNECTION_WAIT_S)  # type: ignore[assignment]  # used as ManifestStore's RLock
        self._db = PgConnection(url)
        self._health_db: PgConnection | None = None
        self._held_up_until = 0.0
        self._health_lock = threading.Lock()
        with self._guarded():
            self._db.execute("SELECT pg_advisory_lock(%s)" % WRITE_LOCK)  # one replica creates the schema
            try:
                self._db.executescript(SCHEMA + AUDIT_SCHEMA)
            finally:
                self._db.execute("SELECT pg_advisory_unlock(%s)" % WRITE_LOCK)

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        """A dropped connection or a server that went away is a 503; the connection is made anew next time.
        A wait or statement cut short by its bound is a 503 too (the connection itself is fine)."""
        try:
            yield
        except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled) as exc:
            self._held_up_until = time.monotonic() + LOCK_TIMEOUT_S
            raise busy(self.url, exc) from None
        except psycopg.OperationalError as exc:
            self._reconnect()
            raise unavailable(self.url, exc) from None

    def close(self) -> None:
        super().close()
        with self._health_lock:
            if self._health_db is not None:
                with contextlib.suppress(psycopg.Error):
                    self._health_db.close()
                self._health_db = None

    def held_up(self) -> bool:
        """A lock held elsewhere cut a statement short less than LOCK_TIMEOUT_S ago: reads a request can do without
        (cleanups, reading back what it just wrote) are left for later rather than waiting for the lock again."""
        return time.monotonic() < self._held_up_until

    def _reconnect(self) -> None:
        with contextlib.suppress(Exception):
            self._db.close()
        try:
            self._db = PgConnection(self.url)
        except BackendUnavailable:
            pass  # the next call tries again

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Any]:
        with self._lock, self._guarded():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException as exc:
                with contextlib.suppress(psycopg.Error):
                    self._db.execute("ROLLBACK")
                if isinstance(exc, psycopg.errors.UniqueViolation):  # e.g. one update_id pushed to two experts
                    raise Conflict(f"another replica recorded the same key meanwhile ({str(exc).splitlines()[0]}); "
                                   "a retry is answered with what was recorded") from None
                raise
            self._db.execute("COMMIT")

    def _all(self, sql: str, *args: Any) -> list[Row]:
        with self._lock, self._guarded():
            return self._db.execute(sql, args).fetchall()

    def _one(self, sql: str, *args: Any) -> Row | None:
        with self._lock, self._guarded():
            return self._db.execute(sql, args).fetchone()

    def expert_count(self) -> int:
        """On a connection of its own (made on first use): /health's read must not hold the one the writes wait
        for while a lock held elsewhere keeps it waiting, nor wait behind them (coordinator/storage/health.py)."""
        with self._health_lock:
            try:
                if self._health_db is None:
                    self._health_db = PgConnection(self.url)
                row = self._health_db.execute("SELECT COUNT(*) AS n FROM experts").fetchone()
            except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled) as exc:
                raise busy(self.url, exc) from None
            except psycopg.OperationalError as exc:
                self._health_db = None
                raise unavailable(self.url, exc) from None
        return int(row["n"])

    def events(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        with self._guarded():
            return super().events(*args, **kwargs)

    def recent_norms(self, expert: str, n: int) -> list[float]:
        with self._guarded():
            return super().recent_norms(expert, n)


class ExpertLocks:
    """Per-expert locks that hold across replicas: a thread lock here, a PostgreSQL advisory lock there.

    Both are waited for at most ``wait`` seconds in all, then a 503: a step holds its expert's lock while
    it computes (seconds), so the bound is generous, but a replica stuck holding it no longer stalls pushes
    for good."""

    def __init__(self, url: str, wait: float = EXPERT_LOCK_WAIT_S) -> None:
        self.url, self.wait = url, wait
        self._local: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    @contextlib.contextmanager
    def hold(self, name: str) -> Iterator[None]:
        with self._guard:
            local = self._local.setdefault(name, threading.Lock())
        deadline = time.monotonic() + self.wait
        if not local.acquire(timeout=self.wait):
            raise self._busy(name)
        try:
            key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big", signed=True)
            # its own session: the lock is released if this process dies
            conn = _connect(self.url, lock_timeout=max(0.001, deadline - time.monotonic()))
            try:
                conn.execute("SELECT pg_advisory_lock(%s)", (key,))
            except psycopg.errors.LockNotAvailable:
                conn.close()
                raise self._busy(name) from None
            except psycopg.OperationalError as exc:
                conn.close()
                raise unavailable(self.url, exc) from None
            try:
                yield
            finally:
                with contextlib.suppress(psycopg.Error):
                    conn.close()  # ends the session, and with it the lock
        finally:
            local.release()

    def _busy(self, name: str) -> BackendUnavailable:
        log_outage(log, self.url + "#expert", "expert %s: its lock was held elsewhere for over %.0f s", name, self.wait)
        return BackendUnavailable(f"expert {name!r} has been busy for over {self.wait:.0f} s (another request or "
                                  "replica holds its lock); nothing was recorded, try again", backend="postgresql")
