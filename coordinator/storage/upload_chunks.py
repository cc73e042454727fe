"""A chunk of a resumable upload on its way to disk: where the front writes it (``ChunkPlace``) and the copies and
digest checks that make it durable (coordinator/storage/upload_files.py keeps the uploads themselves)."""
from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from coordinator.storage.blobs import storage_errors
from coordinator.storage.incoming import SpooledBody
from coordinator.storage.upload_record import Upload
from protocol.errors import BadRequest
from protocol.integrity import Readable, algorithm_of, content_id
from protocol.uploads import PREFIX_DIGEST_HEADER

log = logging.getLogger(__name__)
WRITE_CHUNK = 4 << 20  # bytes read from a chunk's request body at a time


class ChunkStore(Protocol):
    """What a chunk needs of its upload store (coordinator.storage.upload_files.UploadStore)."""

    def part(self, upload: Upload) -> Path: ...

    clock: Callable[[], float]

    def save_offset(self, upload: Upload, offset: int, touched: float) -> None: ...


class ChunkPlace:
    """A chunk being written into its upload's file by the front (``UploadStore.place_chunk``), holding the upload's
    lock: ``commit`` acknowledges it, ``release`` (called once by the front) cuts it off unless committed and
    gives the lock back."""

    def __init__(self, store: ChunkStore, upload: Upload, start: int, length: int, hasher: Any) -> None:
        self.store, self.upload, self.start, self.length, self.hasher = store, upload, start, length, hasher
        self.committed = False
        with storage_errors(f"store a chunk of upload {upload.upload_id}"):
            self.file = open(store.part(upload), "r+b")  # noqa: SIM115 - closed by release
        self.file.seek(start)

    def commit(self, start: int, length: int, spooled: SpooledBody, chunk_digest: str | None,
               prefix_digest: str | None = None) -> None:
        """Check the chunk the front wrote (all of it, the digests it was sent with) and make it durable."""
        upload, store = self.upload, self.store
        if (start, length, spooled.size) != (self.start, self.length, self.length):  # the same head as the place's
            raise BadRequest(f"the chunk's range ({start}, {length} bytes) does not match its body ({spooled.size} "
                             "bytes); send it again", offset=upload.offset)
        check_prefix_algorithm(upload, prefix_digest)
        if chunk_digest is not None and spooled.digest != chunk_digest:
            raise BadRequest("the chunk does not match its digest: it was damaged on the way; send it again",
                             reason="chunk_digest_mismatch", offset=upload.offset)
        check_prefix(upload, self.hasher, prefix_digest)
        with storage_errors(f"store a chunk of upload {upload.upload_id}"):
            self.file.flush()
            os.fsync(self.file.fileno())
            touched = store.clock()
            store.save_offset(upload, start + length, touched)
        self.committed = True
        upload.offset, upload.touched_at, upload.hasher = start + length, touched, self.hasher

    def release(self) -> None:
        try:
            self.file.close()
            if not self.committed:  # nothing past the acknowledged offset stays
                os.truncate(self.store.part(self.upload), self.upload.offset)
        except OSError as exc:  # the part file is cut back to the offset on restart in any case
            log.warning("could not cut upload %s back to its offset %d: %s", self.upload.upload_id,
                        self.upload.offset, exc)
        finally:
            self.upload.lock.release()


def check_prefix_algorithm(upload: Upload, prefix_digest: str | None) -> None:
    if prefix_digest is not None and algorithm_of(prefix_digest) != algorithm_of(upload.digest):
        raise BadRequest(f"{PREFIX_DIGEST_HEADER} must be in the upload's algorithm "
                         f"({algorithm_of(upload.digest)}, as its digest when it was opened)", offset=upload.offset)


def check_prefix(upload: Upload, hasher: Any, prefix_digest: str | None) -> None:
    """The running digest after the chunk against the client's digest of the body up to the chunk's end."""
    if prefix_digest is not None and content_id(algorithm_of(upload.digest), hasher.hexdigest()) != prefix_digest:
        raise BadRequest(f"the body up to the chunk's end does not match its {PREFIX_DIGEST_HEADER}: the chunk was "
                         "damaged on the way; send it again", reason="chunk_digest_mismatch", offset=upload.offset)


def spool_usable(spooled: SpooledBody | None, length: int, chunk_digest: str | None) -> bool:
    """Whether the front's spool file (and its digest) can stand for the chunk: all of it, hashed with the
    algorithm of the chunk's digest (the front hashes with the one the digest header names)."""
    return (spooled is not None and spooled.place is None and spooled.size == length > 0
            and (chunk_digest is None or algorithm_of(chunk_digest) == algorithm_of(spooled.digest)))


def copy_file_hashing(source: Path, out: BinaryIO, start: int, length: int, hasher: Any) -> None:
    """Copy ``length`` bytes of ``source`` to ``out`` at ``start`` in the kernel (copy_file_range), while a
    thread feeds the same bytes, mapped, to ``hasher`` (BLAKE3 and hashlib release the GIL)."""
    with open(source, "rb") as src, mmap.mmap(src.fileno(), length, access=mmap.ACCESS_READ) as mapped:
        hashing = threading.Thread(target=hasher.update, args=(mapped,), name="fedmoe-upload-hash")
        hashing.start()
        try:
            kernel_copy(src, out, start, length)
        finally:
            hashing.join()


def kernel_copy(src: BinaryIO, out: BinaryIO, start: int, length: int) -> None:
    out.flush()
    done = 0
    try:
        while done < length:
            n = os.copy_file_range(src.fileno(), out.fileno(), length - done, done, start + done)
            if n == 0:
                raise OSError(f"the spooled chunk ended after {done} of its {length} bytes")
            done += n
    except OSError as exc:  # no copy_file_range between these file systems (or kernels): copy in Python
        if done or exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        src.seek(0)
        out.seek(start)
        copy_stream(src, out, length, ())


def copy_stream(stream: Readable, out: BinaryIO, length: int, hashers: tuple[Any, ...]) -> None:
    got = 0
    while got < length:
        block = stream.read(min(WRITE_CHUNK, length - got))
        if not block:
            raise BadRequest(f"the chunk ended after {got} of its {length} bytes (Content-Length)")
        out.write(block)
        for h in hashers:
            h.update(block)
        got += len(block)
