"""Who may call the coordinator: the admin token, the join token and per-worker tokens.

- The **admin** token can do everything. It comes from ``--admin-token-file`` or
  ``<data dir>/admin_token``, made on first start (mode 0600).
- The **join** token only registers workers. It lives in ``<data dir>/join_token`` (mode 0600);
  the operator hands it to the machines that may join. Delete it and restart to rotate it.
- The **relay join** token only registers relays (``coordinator.relay_registry``), in ``<data dir>/relay_join_token``
  (mode 0600), for the machines that run relays. A relay token may push for every expert, so holding the
  workers' join token is not enough to get one.
- A **worker** token is what registering returns: bound to one worker id and its specialty,
  valid for ``token_ttl`` seconds. A worker renews it by registering again with that token, even
  once it has expired (the newest token of each worker is kept for this); the client keeps it in
  the per-user config dir (``protocol.credentials``), so a restarted worker renews the same way.
  While a worker id holds an unexpired token it is *active*: the join token cannot register it
  again (that would hand a stranger a token acting as it); only its own token or the admin can.

Tokens are 32 random bytes (URL-safe base64) with a prefix that says the role. The coordinator
keeps only SHA-256 hashes: admin and join hashes in memory (their files are the operator's
copy), worker token hashes in ``auth.sqlite``; comparisons are constant-time.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from protocol.errors import Forbidden, NotFound, Unauthorized
from protocol.files import private_dir, private_file

log = logging.getLogger(__name__)

ADMIN, JOIN, WORKER, RELAY, RELAY_JOIN = "admin", "join", "worker", "relay", "relay_join"
PREFIX = {ADMIN: "fmadm_", JOIN: "fmjoin_", WORKER: "fmwrk_", RELAY: "fmrly_", RELAY_JOIN: "fmrjoin_"}
RELAY_SPECIALTY = "*"
"""A relay's token is kept among worker tokens under worker id ``relay:<id>`` and this specialty (no
expert can be named "*"): it may push and pull for any expert, on behalf of the relay's workers."""


def relay_key(relay_id: str) -> str:
    """The worker-token row key of a relay (never a valid worker id: ':' is not allowed in one)."""
    return f"relay:{relay_id}"

SCHEMA = """
CREATE TABLE IF NOT EXISTS worker_tokens (
    hash TEXT PRIMARY KEY,        -- sha256 of the token; the token itself is never stored
    worker_id TEXT NOT NULL,
    specialty TEXT NOT NULL,
    issued_at REAL NOT NULL,
    expires_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS worker_tokens_by_worker ON worker_tokens (worker_id);
CREATE TABLE IF NOT EXISTS revoked_workers (
    worker_id TEXT PRIMARY KEY,
    revoked_at REAL NOT NULL
);
"""


@dataclass(frozen=True)
class Principal:
    """The caller a token stands for."""

    role: str
    """admin, join, worker, relay or relay_join."""
    worker_id: str | None = None
    specialty: str | None = None
    expired: bool = False
    """A worker token past its expiry: good for renewing it (registering again), nothing else."""


def new_token(role: str) -> str:
    return PREFIX[role] + secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def read_or_create_token_file(path: Path, role: str) -> str:
    """The token in ``path``; on first start, a new one written there with mode 0600."""
    if path.exists():
        token = path.read_text().strip()
        if len(token) < 16:
            raise ValueError(f"token file {str(path)!r} holds {len(token)} characters; use at least 16 random "
                             "ones, or delete it to get a new token")
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            try:  # ours to fix (a data dir made before files were private); else say what to do
                os.chmod(path, 0o600)
                log.warning("%s was readable by other users; made it 0600", path)
            except OSError:
                log.warning("%s is readable by other users; chmod 600 it", path)
        return token
    token = new_token(role)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    log.info("wrote a new %s token to %s (mode 0600)", role, path)
    return token


class TokenStore:
    def __init__(self, data_dir: Path, admin_token_file: Path | None, token_ttl: float) -> None:
        private_dir(data_dir)
        self.admin_token = read_or_create_token_file(admin_token_file or data_dir / "admin_token", ADMIN)
        self.join_token_file = data_dir / "join_token"
        join_token = read_or_create_token_file(self.join_token_file, JOIN)
        if join_token == self.admin_token:
            raise ValueError("the join token must differ from the admin token (--admin-token-file)")
        self.relay_join_token_file = data_dir / "relay_join_token"
        relay_join_token = read_or_create_token_file(self.relay_join_token_file, RELAY_JOIN)
        if relay_join_token in (self.admin_token, join_token):
            raise ValueError(f"{self.relay_join_token_file} must hold a token of its own, not the admin or join token")
        self._admin_hash, self._join_hash = token_hash(self.admin_token), token_hash(join_token)
        self._relay_join_hash = token_hash(relay_join_token)
        self.token_ttl = token_ttl
        self.clock: Callable[[], float] = time.time
        """Wall-clock seconds that issue and expire tokens (tests move it forward instead of sleeping)."""
        self._path = private_file(data_dir / "auth.sqlite")  # 0600, and so its -wal/-shm (SQLite copies the mode)
        # hash -> (principal, expires_at) of worker tokens seen valid: one SQLite open per request cost
        # ~1 ms. One process serves the API (coordinator.server); a hit is checked against the
        # in-memory revoked set, which revoke() updates before anything else.
        self._valid: dict[str, tuple[Principal, float]] = {}
        self._valid_lock = threading.Lock()
        self._issue_lock = threading.Lock()
        with self._db() as db:
            db.executescript(SCHEMA)
            self._revoked = {r[0] for r in db.execute("SELECT worker_id FROM revoked_workers")}

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """A short-lived connection per operation: nothing to close, safe from any thread."""
        db = sqlite3.connect(str(self._path), timeout=30, isolation_level=None)
        try:
            yield db
        finally:
            db.close()

    def authenticate(self, token: str | None, allow_expired: bool = False) -> Principal:
        """The caller behind ``token``, or Unauthorized saying what is wrong with it.

        ``allow_expired``: an expired (not revoked) worker token is returned with ``expired=True``.
        """
        if not token:
            raise Unauthorized("this endpoint needs a token: send 'Authorization: Bearer <token>' "
                               "(workers: --token or FEDMOE_TOKEN)")
        digest = token_hash(token)
        if hmac.compare_digest(digest, self._admin_hash):
            return Principal(ADMIN)
        if hmac.compare_digest(digest, self._join_hash):
            return Principal(JOIN)
        if hmac.compare_digest(digest, self._relay_join_hash):
            return Principal(RELAY_JOIN)
        with self._valid_lock:
            cached = self._valid.get(digest)
        if cached is not None and cached[1] > self.clock() and cached[0].worker_id not in self._revoked:
            return cached[0]
        with self._db() as db:  # looked up by hash: timing reveals nothing about a valid token
            row = db.execute("SELECT t.worker_id, t.specialty, t.expires_at, r.revoked_at FROM worker_tokens t "
                             "LEFT JOIN revoked_workers r USING (worker_id) WHERE t.hash = ?", (digest,)).fetchone()
        if row is None:
            raise Unauthorized("unknown token; check --token / FEDMOE_TOKEN")
        worker_id, specialty, expires_at, revoked_at = row
        if revoked_at is not None:
            raise Unauthorized(f"worker {worker_id!r} was revoked by an admin", reason="revoked")
        if expires_at <= self.clock():
            if allow_expired:
                return Principal(WORKER, worker_id, specialty, expired=True)
            raise Unauthorized(f"the token of worker {worker_id!r} expired; register again (with this token, "
                               "or the join token once no token of this worker is valid)",
                               reason="expired")
        principal = Principal(WORKER, worker_id, specialty)
        if specialty == RELAY_SPECIALTY:  # a relay coordinator (coordinator.relay_registry)
            principal = Principal(RELAY, worker_id.removeprefix("relay:"))
        with self._valid_lock:
            if len(self._valid) > 10_000:
                self._valid.clear()
            self._valid[digest] = (principal, expires_at)
        return principal

    def check_not_revoked(self, worker_id: str) -> None:
        if worker_id in self._revoked:
            raise Forbidden(f"worker {worker_id!r} was revoked by an admin and cannot register again")

    def owner(self, token: str | None) -> str | None:
        """The worker a worker token was issued to, valid or not (who a refused caller is), else None."""
        if not token or not token.startswith(PREFIX[WORKER]):  # a flood of junk tokens costs no lookup
            return None
        with self._db() as db:
            row = db.execute("SELECT worker_id FROM worker_tokens WHERE hash = ?", (token_hash(token),)).fetchone()
        return row[0] if row else None

    def active_until(self, worker_id: str) -> float | None:
        """When the last unexpired token of ``worker_id`` expires; None if it holds none (not active)."""
        with self._db() as db:
            (until,) = db.execute("SELECT MAX(expires_at) FROM worker_tokens WHERE worker_id = ?",
                                  (worker_id,)).fetchone()
        return until if until is not None and until > self.clock() else None

    def check_may_register(self, caller: Principal, worker_id: str, specialty: str) -> None:
        """Forbidden unless ``caller`` may register ``worker_id`` for ``specialty`` (module docstring)."""
        self.check_not_revoked(worker_id)
        if caller.role == ADMIN:
            return
        if caller.role == WORKER:
            if caller.worker_id != worker_id:
                raise Forbidden(f"a token of worker {caller.worker_id!r} can only renew itself, not register "
                                f"{worker_id!r}; register new workers with the join token")
            if caller.specialty != specialty:
                raise Forbidden(f"the token of worker {worker_id!r} is for expert {caller.specialty!r}, not "
                                f"{specialty!r}; use another --worker-id for another specialty")
            return
        if caller.role != JOIN:
            raise Forbidden(f"a {caller.role} token cannot register workers; use the join token")
        until = self.active_until(worker_id)
        if until is not None:
            raise Forbidden(f"worker id {worker_id!r} is in use (it holds a token valid until "
                            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(until))}); only its own token "
                            "(a restarted worker's client keeps it under ~/.config/fedmoe) or the admin can register "
                            "it again: start this worker with another --worker-id", reason="worker_id_in_use")

    def issue(self, worker_id: str, specialty: str, caller: Principal = Principal(ADMIN),
              role: str = WORKER) -> dict[str, object]:
        """A new token for this worker and specialty, if ``caller`` may register it.

        Expired tokens are dropped on the way, except each worker's newest: that one may still renew.
        ``role=RELAY``: a relay's token (``worker_id`` is then ``relay_key(relay id)``).
        """
        token, now = new_token(role), self.clock()
        with self._issue_lock, self._db() as db:  # two joins of one new id: the second sees the first's token
            if role == RELAY:
                self.check_may_register_relay(caller, worker_id)
            else:
                self.check_may_register(caller, worker_id, specialty)
            db.execute("DELETE FROM worker_tokens WHERE expires_at <= ? AND issued_at < (SELECT MAX(t.issued_at) "
                       "FROM worker_tokens t WHERE t.worker_id = worker_tokens.worker_id)", (now,))
            db.execute("INSERT INTO worker_tokens VALUES (?, ?, ?, ?, ?)",
                       (token_hash(token), worker_id, specialty, now, now + self.token_ttl))
        return {"token": token, "token_expires_at": now + self.token_ttl}

    def check_may_register_relay(self, caller: Principal, key: str) -> None:
        """Like check_may_register, for a relay: the relay join token (if the relay id is not active), the
        relay's own token (renewal) or the admin. The workers' join token cannot: a relay token pushes for every
        expert, and its holder would be a relay (issue 30: any worker could mint relay identities)."""
        self.check_not_revoked(key)
        if caller.role == ADMIN or (caller.role == RELAY and relay_key(caller.worker_id or "") == key):
            return
        if caller.role == JOIN:
            raise Forbidden("the workers' join token cannot register a relay: a relay joins with the root's relay "
                            f"join token ({self.relay_join_token_file.name} in the root's data dir; relay flag "
                            "--relay-join-token-file)", reason="relay_join_token_needed")
        if caller.role != RELAY_JOIN:
            raise Forbidden("only the relay join token, the admin or the relay's own token can register a relay")
        if self.active_until(key) is not None:
            raise Forbidden(f"relay id {key.removeprefix('relay:')!r} is in use (it holds a valid token); restart "
                            "that relay on its own data dir, or use another --relay-id", reason="relay_id_in_use")

    def revoke(self, worker_id: str, known: bool) -> dict[str, object]:
        """Revoke every token of ``worker_id`` and refuse its registration from now on."""
        with self._db() as db:
            tokens = db.execute("SELECT COUNT(*) FROM worker_tokens WHERE worker_id = ?", (worker_id,)).fetchone()[0]
            if not known and not tokens:
                raise NotFound(f"no worker {worker_id!r}")
            with self._valid_lock:
                self._revoked.add(worker_id)
                self._valid = {h: v for h, v in self._valid.items() if v[0].worker_id != worker_id}
            db.execute("INSERT OR IGNORE INTO revoked_workers VALUES (?, ?)", (worker_id, time.time()))
        log.info("revoked worker %s (%d token(s))", worker_id, tokens)
        return {"worker_id": worker_id, "revoked": True, "tokens": tokens}

    def revoked_workers(self) -> set[str]:
        with self._valid_lock:
            return set(self._revoked)
