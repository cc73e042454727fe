"""Writing user-visible files safely: all or nothing, with ordinary permissions."""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable: fsync the directory itself."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes) -> None:
    """Write to a temp file beside ``path``, fsync, rename, fsync the directory: readers see the old
    file or the new one, and after a crash so does the next start.

    mkstemp creates files readable by the owner only; the result gets the usual 0o666 & ~umask.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) readable by its owner only (0700); tighten it if it exists."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        log.warning("%s was open to other users (mode %o); made it 0700", path, path.stat().st_mode & 0o777)
        os.chmod(path, 0o700)
    return path


def private_file(path: Path) -> Path:
    """Make sure ``path`` exists with mode 0600 before a library (SQLite) opens it.

    SQLite creates a database with 0644 & ~umask, and its -wal/-shm files with the database's
    own mode, so creating the database file 0600 first keeps all three private.
    """
    path = Path(path)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    for companion in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if companion.exists() and companion.stat().st_mode & 0o077:
            os.chmod(companion, 0o600)
    return path
