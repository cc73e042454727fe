"""Where a client finds its token: ``--token``, then ``FEDMOE_TOKEN``, then the local credentials file.

The local file is how a worker on the coordinator's own machine needs no configuration: when a
coordinator starts listening it records its admin token there under ``host:port`` for each name
a same-machine client may use (127.0.0.1, localhost, the host name, the bound address), and
removes its entries when it stops. The file lives in a per-user directory (``FEDMOE_CONFIG_DIR``,
else ``$XDG_CONFIG_HOME/fedmoe``, else ``~/.config/fedmoe``) with mode 0700/0600: anyone who can
read it could read the coordinator's data dir too.

Several coordinators may start and stop at once (tests, one per port), so every change is a
read-modify-write under an exclusive ``flock`` and lands with an atomic rename. Entries carry
the coordinator's pid; entries of processes that are gone are pruned on each write, and a new
coordinator on a port simply replaces what an old one left there.

Worker tokens: a worker's client keeps the token registering returned in ``worker_tokens.json``
in the same directory, under the coordinator's ``host:port`` and the worker id. A worker id that
holds a valid token can only be registered again with that token (or by the admin), so this is
how a restarted worker gets its id back; the coordinator accepts it for renewal even expired.
Entries expired for over ``WORKER_TOKEN_KEPT`` are dropped on each write.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

TOKEN_ENV = "FEDMOE_TOKEN"
CONFIG_DIR_ENV = "FEDMOE_CONFIG_DIR"
FILE_NAME = "credentials.json"
WORKER_TOKENS_FILE = "worker_tokens.json"
WORKER_TOKEN_KEPT = 30 * 86400.0
"""Seconds a worker token is kept after it expired (the coordinator keeps only each worker's newest)."""


def config_dir() -> Path:
    explicit = os.environ.get(CONFIG_DIR_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "fedmoe"


def credentials_path() -> Path:
    return config_dir() / FILE_NAME


def local_names(bound_host: str) -> list[str]:
    """Host names a client on this machine may use to reach a coordinator bound to ``bound_host``."""
    if bound_host in ("0.0.0.0", "::", ""):
        return ["127.0.0.1", "localhost", "::1", socket.gethostname().lower()]
    if bound_host in ("127.0.0.1", "::1", "localhost"):
        return list(dict.fromkeys([bound_host, "localhost"]))
    return [bound_host.lower()]


def _key(host: str, port: int) -> str:
    return f"{host.lower()}:{port}"


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


@contextlib.contextmanager
def _locked_entries(name: str = FILE_NAME) -> Iterator[dict[str, Any]]:
    """The file's entries, locked for update; what the caller leaves in the dict is written back."""
    directory = config_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(directory / (name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = _read(directory / name)
        yield entries
        live = {k: v for k, v in entries.items() if isinstance(v, dict) and _still_wanted(name, v)}
        tmp = directory / f".{name}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(live, out, indent=1)
        os.replace(tmp, directory / name)


def _still_wanted(name: str, entry: dict[str, Any]) -> bool:
    if name == WORKER_TOKENS_FILE:
        expires = entry.get("expires_at")
        return isinstance(expires, (int, float)) and expires + WORKER_TOKEN_KEPT > time.time()
    return _pid_alive(entry.get("pid"))


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def publish_local_token(bound_host: str, port: int, token: str, scheme: str = "http") -> None:
    """Record ``token`` for every local name of this coordinator (called once it listens)."""
    with _locked_entries() as entries:
        for host in local_names(bound_host):
            entries[_key(host, port)] = {"token": token, "pid": os.getpid(), "scheme": scheme}


def withdraw_local_token(bound_host: str, port: int) -> None:
    """Remove this process's entries for ``port`` (called when the coordinator stops)."""
    with _locked_entries() as entries:
        for host in local_names(bound_host):
            entry = entries.get(_key(host, port))
            if isinstance(entry, dict) and entry.get("pid") == os.getpid():
                del entries[_key(host, port)]


def local_token(url: str) -> str | None:
    """The token a coordinator on this machine recorded for ``url``'s host and port, if any."""
    parts = urlsplit(url)
    if not parts.hostname:
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    entry = _read(credentials_path()).get(_key(parts.hostname, port))
    if isinstance(entry, dict) and isinstance(entry.get("token"), str) and _pid_alive(entry.get("pid")):
        return entry["token"]
    return None


def _worker_key(url: str, worker_id: str) -> str | None:
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    return f"{_key(parts.hostname, port)}/{worker_id}" if parts.hostname else None


def stored_worker_token(url: str, worker_id: str) -> str | None:
    """The token the coordinator at ``url`` last gave ``worker_id`` on this machine, if kept."""
    key = _worker_key(url, worker_id)
    entry = _read(config_dir() / WORKER_TOKENS_FILE).get(key) if key else None
    return entry["token"] if isinstance(entry, dict) and isinstance(entry.get("token"), str) else None


def store_worker_token(url: str, worker_id: str, token: str, expires_at: float) -> None:
    """Keep ``worker_id``'s token for the coordinator at ``url`` (file mode 0600)."""
    key = _worker_key(url, worker_id)
    if key is not None:
        with _locked_entries(WORKER_TOKENS_FILE) as entries:
            entries[key] = {"token": token, "expires_at": expires_at}


def resolve_token(url: str, explicit: str | None = None) -> tuple[str | None, str]:
    """(token, where it came from): an explicit token, ``FEDMOE_TOKEN``, or the local file."""
    if explicit:
        return explicit, "--token"
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV], TOKEN_ENV
    token = local_token(url)
    if token:
        return token, f"the local coordinator's entry in {credentials_path()}"
    return None, "no token (pass --token or set FEDMOE_TOKEN)"
