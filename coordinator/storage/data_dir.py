"""One process per data dir, and a root's data dir never opened as a relay's (or the other way round).

Without this, the cli example ``run_coordinator.py --upstream http://root:5000 --port 5001`` run on the root's
machine (same working directory, so the same default ``--data-dir fedmoe-data``) opened the root's live data dir
as a relay store: its start-up sweep deleted every blob it did not know (all of the root's expert versions), and
the root's next start quarantined the experts whose blobs were gone. Two roots on one dir did the same with each
other's just-written blobs. A process now holds an exclusive ``flock`` on ``<data-dir>/.lock`` while it runs (the
kernel drops it when the process dies, kill -9 included, so a restart is never refused), and a data dir remembers
which kind of process made it.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from protocol.files import private_dir

LOCK_NAME = ".lock"
ROOT, RELAY = "root", "relay"
# what each kind of process leaves in its data dir (coordinator/storage/expert_store.py, coordinator/relay/relay_store.py)
MARKERS = {ROOT: "manifest.sqlite", RELAY: "relay.sqlite"}
HINT = {ROOT: "run_coordinator.py --data-dir DIR", RELAY: "run_coordinator.py --upstream URL --data-dir DIR"}


class DataDirError(ValueError):
    """The data dir cannot be used by this process (in use, a file, or another kind's)."""


def claim_data_dir(path: Path, role: str) -> IO[str]:
    """Make ``path`` (0700) and lock it for this process; keep the returned file open as long as the process serves.

    DataDirError names the flag to change when the dir is a file, is locked by another live process, or holds the
    other kind's data (a relay's queue in a root's dir or a root's experts in a relay's).
    """
    if path.exists() and not path.is_dir():
        raise DataDirError(f"--data-dir {str(path)!r} is a file; give a directory (it is created if missing)")
    try:
        private_dir(path)
    except OSError as exc:
        raise DataDirError(f"--data-dir {str(path)!r} cannot be created: {exc.strerror}") from None
    other = RELAY if role == ROOT else ROOT
    if (path / MARKERS[other]).exists():
        raise DataDirError(f"--data-dir {str(path)!r} holds a {other} coordinator's data ({MARKERS[other]}); "
                           f"a {role} needs its own data dir: {HINT[role]}")
    lock = open(path / LOCK_NAME, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the process's life
    os.chmod(lock.fileno(), 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise DataDirError(f"--data-dir {str(path)!r} is in use by another coordinator or relay (pid {holder}); "
                           "stop it first, or give this one its own --data-dir") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock
