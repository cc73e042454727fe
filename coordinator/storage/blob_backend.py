"""What ``ExpertStore`` needs of a blob backend: ``BlobStore`` (local files) or ``S3BlobStore`` (an object store)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, ContextManager, Protocol

from protocol.integrity import DEFAULT_ALGORITHM, Readable


class BlobBackend(Protocol):
    """Immutable blobs named by their SHA-256 (``coordinator.storage.blobs.BlobStore``: local files).

    Temp files are always local (bodies are checked before they are stored); ``adopt`` moves one
    into the backend, durably, under its digest. ``receive`` and ``write_temp`` leave nothing behind
    when they fail, and ``adopt`` of a digest already stored just drops the temp file.
    """

    tmp_dir: Path

    def receive(self, stream: Readable, limit: int, length: int | None = None,
                algorithm: str = DEFAULT_ALGORITHM) -> Path: ...
    def take_spooled(self, path: Path, digest: str) -> Path: ...  # a body the HTTP front spooled and hashed
    def write_temp(self, write: Callable[[Path], None]) -> Path: ...
    def digest_of(self, tmp: Path, algorithm: str | None = None) -> str: ...
    def forget(self, tmp: Path) -> None: ...
    def link_received(self, path: Path, digest: str) -> Path: ...
    def adopt(self, tmp: Path, digest: str | None = None, sync: bool = True) -> str: ...
    def flush(self) -> None: ...  # make the renames of adopt(sync=False) durable
    def delete(self, digest: str) -> None: ...
    def digests(self) -> Iterator[str]: ...
    def open(self, digest: str) -> BinaryIO: ...  # FileNotFoundError once deleted
    def local_file(self, digest: str) -> ContextManager[Path]: ...  # fetched first if remote
    def local_path(self, digest: str) -> Path | None: ...  # None: not a local file (no sendfile)
    def quarantine(self, digest: str, reason: str) -> str | None: ...  # a copy's name; None if gone
    @property
    def quarantine_location(self) -> str: ...
    @property
    def location(self) -> str: ...  # where the blobs are, as the operator named it (for messages)
    def missing(self, digests: Iterable[str]) -> set[str]: ...  # those the store does not hold
    def restore(self, digest: str) -> bool: ...  # put a lost blob back from a copy held elsewhere (a cache)
    on_lost: Callable[[], None] | None  # set by the ExpertStore: called when the store finds it lost blobs


class PresigningBlobBackend(BlobBackend, Protocol):
    """A remote blob backend that hands out direct download URLs (``coordinator.storage.backends.s3``)."""

    def presigned_url(self, digest: str) -> str: ...
    def remote_size(self, digest: str) -> int: ...  # bytes of the blob in the store (0 if absent)


class BlobReads(Protocol):
    """What a reader may do with stored blobs (``ExpertStore.blobs``): writes and deletions go through the store."""

    def open(self, digest: str) -> BinaryIO: ...  # FileNotFoundError once deleted (pruned meanwhile)
    def local_file(self, digest: str) -> ContextManager[Path]: ...  # fetched first if remote
    def local_path(self, digest: str) -> Path | None: ...  # None: not a local file (no sendfile)
    def missing(self, digests: Iterable[str]) -> set[str]: ...  # those the store does not hold
    @property
    def location(self) -> str: ...  # where the blobs are, as the operator named it (for messages)
    @property
    def quarantine_location(self) -> str: ...  # where quarantined copies are kept (for log lines)
