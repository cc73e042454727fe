"""Request bodies on their way in: always a local, fsynced temp file, whatever the blob backend.

A body is checked and decoded before anything is stored; then ``ExpertStore`` adopts it into the blob store
together with the row naming it, or the caller ``forget``s it (refused, a duplicate).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from coordinator.storage.blob_backend import BlobBackend
from coordinator.storage.blobs import storage_errors
from protocol.integrity import DEFAULT_ALGORITHM, Readable


class BodySpool:
    """The temp files of one blob backend (``ExpertStore.bodies``)."""

    def __init__(self, blobs: BlobBackend) -> None:
        self._blobs = blobs

    @property
    def dir(self) -> Path:
        """A local directory for request bodies on their way in (same file system as the temp files)."""
        return self._blobs.tmp_dir

    def receive(self, stream: Readable, limit: int, length: int | None = None,
                algorithm: str = DEFAULT_ALGORITHM) -> Path:
        """A request body copied to a fsynced temp file (see ``BlobStore.receive``)."""
        with storage_errors("receive the request body"):
            return self._blobs.receive(stream, limit, length, algorithm)

    def take_spooled(self, path: Path, digest: str) -> Path:
        """A body the HTTP front already wrote into ``spool_dir`` and hashed, fsynced (no second copy)."""
        with storage_errors("receive the request body"):
            return self._blobs.take_spooled(path, digest)

    def digest_of(self, tmp: Path, algorithm: str | None = None) -> str:
        """Content id of a temp file (protocol/integrity.py), in ``algorithm`` if given."""
        return self._blobs.digest_of(tmp, algorithm)

    def link_received(self, path: Path, digest: str) -> Path:
        """A temp file holding the finished resumable upload at ``path`` (hard-linked when it can be), whose
        digest is already known; it is then stored or forgotten like a body ``receive`` wrote."""
        with storage_errors("receive the upload"):
            return self._blobs.link_received(path, digest)

    def forget(self, tmp: Path) -> None:
        """Drop a temp file that will not be stored (refused, a duplicate, or already adopted)."""
        self._blobs.forget(tmp)

    def write_temp(self, write: Callable[[Path], None], action: str | None = None) -> Path:
        """A temp file filled by ``write(path)`` and fsynced; a full disk is a 507 naming ``action``."""
        if action is None:
            return self._blobs.write_temp(write)
        with storage_errors(action):
            return self._blobs.write_temp(write)
