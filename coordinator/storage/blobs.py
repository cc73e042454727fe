"""Immutable content-addressed blobs on disk.

A blob's file name is its content id (protocol/integrity.py): ``b3-<BLAKE3 hex>`` for blobs
written since 0.7, the bare SHA-256 hex for older ones (both kinds are read and verified). Every write goes to a temp file
in the same directory tree, is fsynced, renamed into place and the directory is
fsynced, so a crash leaves either the whole blob or nothing under its name.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sqlite3
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from safetensors import SafetensorError

from protocol.errors import BadRequest, InsufficientStorage, PayloadTooLarge
from protocol.files import fsync_dir, private_dir
from protocol.integrity import DEFAULT_ALGORITHM, Readable, algorithm_of, hash_file, hex_of, new_hasher, content_id

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # reads of stored files
RECEIVE_CHUNK = 4 << 20  # reads of a request body: measured best of 1-16 MiB (bench/transport.py)


class BlobStore:
    """Blobs under ``root/<aa>/<content id>`` (aa: its first two hex digits), temp files under ``root/tmp``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()  # paths handed to send_file must not depend on its base folder
        self.tmp_dir = private_dir(self.root / "tmp")
        self.quarantine_dir = self.root.parent / "quarantine"
        # Leftovers of a crash mid-write were never acknowledged: drop them.
        for leftover in self.tmp_dir.iterdir():
            leftover.unlink(missing_ok=True)
        self._received_digests: dict[Path, str] = {}  # temp file -> SHA-256 computed while receiving
        self._digests_guard = threading.Lock()
        self._unsynced_dirs: set[Path] = set()  # renamed into by adopt(sync=False), for the next flush()

    def path(self, digest: str) -> Path:
        return self.root / hex_of(digest)[:2] / digest

    # reads, as coordinator.storage.blob_backend.BlobBackend names them

    def local_path(self, digest: str) -> Path | None:
        """The blob's own file (it may be gone if pruned meanwhile)."""
        return self.path(digest)

    def open(self, digest: str) -> BinaryIO:
        return open(self.path(digest), "rb")

    @contextlib.contextmanager
    def local_file(self, digest: str) -> Iterator[Path]:
        yield self.path(digest)

    def exists(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def new_temp(self) -> Path:
        fd, name = tempfile.mkstemp(dir=self.tmp_dir, suffix=".part")
        os.close(fd)
        return Path(name)

    def receive(self, stream: Readable, limit: int, length: int | None = None,
                algorithm: str = DEFAULT_ALGORITHM) -> Path:
        """Copy a request body to a fsynced temp file, failing past ``limit`` bytes.

        With ``length`` (the Content-Length) exactly that many bytes are read from ``stream``,
        which may then be the server's raw ``wsgi.input``: werkzeug's LimitedStream around it
        copies every chunk twice more (measured: receive 1.6x slower under gunicorn).

        The digest (``algorithm``, the one the client named) is computed on a second thread while the
        body arrives (both hashes release the GIL), so ``adopt`` need not read a large body back; at
        most two chunks are in memory.
        """
        tmp = self.new_temp()
        total = 0
        hasher = new_hasher(algorithm, length or 0)
        try:
            with open(tmp, "wb") as out, ThreadPoolExecutor(1) as hashing:
                hashed = hashing.submit(lambda: None)
                while chunk := stream.read(RECEIVE_CHUNK if length is None else min(RECEIVE_CHUNK, length - total)):
                    total += len(chunk)
                    if total > limit:
                        raise PayloadTooLarge(f"body is larger than the limit of {limit} bytes "
                                              "(coordinator flag --max-body-mb)", limit=limit)
                    out.write(chunk)
                    hashed.result()
                    hashed = hashing.submit(hasher.update, chunk)
                hashed.result()
                if length is not None and total < length:
                    raise BadRequest(f"body ended after {total} of its {length} bytes (Content-Length)")
                out.flush()
                os.fsync(out.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._digests_guard:
            self._received_digests[tmp] = content_id(algorithm, hasher.hexdigest())
        return tmp

    def take_spooled(self, path: Path, digest: str) -> Path:
        """Take over a body the HTTP front already spooled into ``tmp_dir`` and hashed: fsync it, keep its
        digest for ``adopt``. Saves the copy ``receive`` makes (the front wrote the file as it arrived)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        with self._digests_guard:
            self._received_digests[path] = digest
        return path

    def adopt(self, tmp: Path, digest: str | None = None, sync: bool = True) -> str:
        """Move a fsynced temp file into the store under its digest; return the digest.

        The digest is the one given, else the one hashed while the file was received, else computed
        (BLAKE3). ``sync=False``: the rename is made durable by the next ``flush()`` instead of a
        directory fsync of its own (group commit, coordinator/storage/group_commit.py).
        """
        with self._digests_guard:
            received = self._received_digests.pop(tmp, None)
        digest = digest or received or hash_file(tmp)
        dest = self.path(digest)
        dest.parent.mkdir(exist_ok=True)
        if dest.exists():
            tmp.unlink()
        else:
            os.replace(tmp, dest)
            if sync:
                fsync_dir(dest.parent)
            else:
                with self._digests_guard:
                    self._unsynced_dirs.add(dest.parent)
        return digest

    def flush(self) -> None:
        """Make every rename of ``adopt(sync=False)`` so far durable: one fsync per directory renamed into."""
        with self._digests_guard:
            dirs, self._unsynced_dirs = self._unsynced_dirs, set()
        try:
            for directory in dirs:
                fsync_dir(directory)
        except BaseException:
            with self._digests_guard:
                self._unsynced_dirs |= dirs  # the next flush tries them again
            raise

    def digest_of(self, tmp: Path, algorithm: str | None = None) -> str:
        """Content id of a temp file: the one hashed while it was received (if of ``algorithm``, when
        given), else read and hashed now."""
        with self._digests_guard:
            received = self._received_digests.get(tmp)
        if received and (algorithm is None or algorithm_of(received) == algorithm):
            return received
        return hash_file(tmp, algorithm or DEFAULT_ALGORITHM)

    def forget(self, tmp: Path) -> None:
        """Drop a received temp file that was not adopted (refused or a duplicate)."""
        with self._digests_guard:
            self._received_digests.pop(tmp, None)
        tmp.unlink(missing_ok=True)

    def link_received(self, path: Path, digest: str) -> Path:
        """A received temp file that is a hard link to ``path`` (a finished resumable upload, fsynced, in this
        data dir), whose SHA-256 is already known; ``adopt`` or ``forget`` it like one ``receive`` wrote."""
        tmp = self.new_temp()
        tmp.unlink()
        try:
            os.link(path, tmp)
        except OSError:  # another file system (EXDEV) or no hard links: copy
            try:
                shutil.copyfile(path, tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        with self._digests_guard:
            self._received_digests[tmp] = digest
        return tmp

    def write_temp(self, write: Callable[[Path], object]) -> Path:
        """Let ``write(path)`` fill a temp file and fsync it; ``adopt`` it to store it."""
        tmp = self.new_temp()
        try:
            write(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def put_file(self, write: Callable[[Path], object]) -> str:
        """Let ``write(path)`` fill a temp file, then fsync and adopt it."""
        return self.adopt(self.write_temp(write))

    def put_bytes(self, data: bytes) -> str:
        return self.put_file(lambda p: p.write_bytes(data))

    def delete(self, digest: str) -> None:
        self.path(digest).unlink(missing_ok=True)

    def quarantine(self, digest: str, reason: str) -> str | None:
        """Keep a copy of a blob that cannot be used under ``<data dir>/quarantine`` (for a human to
        inspect); the blob itself is dropped with its rows. Returns the copy's name, None if it was gone."""
        private_dir(self.quarantine_dir)
        kept = self.quarantine_dir / digest
        try:
            os.link(self.path(digest), kept)  # same file system: no copy, and safe if it is deleted next
        except FileExistsError:
            pass
        except FileNotFoundError:
            return None
        except OSError:  # e.g. blobs/ on another file system (EXDEV): copy
            shutil.copyfile(self.path(digest), kept)
        log.error("quarantined blob %s (%s): a copy is kept in %s", digest[:16], reason, self.quarantine_dir)
        return kept.name

    @property
    def quarantine_location(self) -> str:
        return str(self.quarantine_dir)

    # what start-up recovery asks (coordinator/recovery.py) ----------------------------------

    on_lost: Callable[[], None] | None = None
    """Called when the store finds it lost blobs while running (a remote store's bucket came back empty);
    local files have no such event."""

    @property
    def location(self) -> str:
        """Where the blobs are, as the operator named it (for messages)."""
        return f"{self.root} (in --data-dir)"

    def missing(self, digests: Iterable[str]) -> set[str]:
        """Those of ``digests`` the store does not hold."""
        return {d for d in digests if not self.path(d).is_file()}

    def restore(self, digest: str) -> bool:
        """Put back a blob the store lost from a copy of it held elsewhere; local files have no other copy."""
        return False

    def digests(self) -> Iterator[str]:
        for sub in self.root.iterdir():
            if sub.is_dir() and sub.name != "tmp":
                yield from (p.name for p in sub.iterdir() if p.is_file())

    def verify(self, digest: str) -> bool:
        return hash_file(self.path(digest), algorithm_of(digest)) == digest


FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
SQLITE_FULL = 13


def is_storage_full(exc: BaseException) -> bool:
    """A write failed because the disk or the quota is full (OS, SQLite or safetensors' own error)."""
    if isinstance(exc, OSError):
        return exc.errno in FULL_ERRNOS
    if isinstance(exc, sqlite3.Error):
        return (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF == SQLITE_FULL
    if isinstance(exc, SafetensorError):  # it reports I/O errors as text: "... (os error 28)"
        return any(f"(os error {n})" in str(exc) for n in FULL_ERRNOS)
    return False


@contextlib.contextmanager
def storage_errors(action: str) -> Iterator[None]:
    """Turn "disk full" into InsufficientStorage (507) saying what was not done."""
    try:
        yield
    except (OSError, sqlite3.Error, SafetensorError) as exc:
        if not is_storage_full(exc):
            raise
        log.error("disk full: could not %s (%s)", action, exc)
        raise InsufficientStorage(f"the coordinator's disk is full: could not {action}; nothing was recorded. "
                                  "Free space in its --data-dir, then send it again") from None
