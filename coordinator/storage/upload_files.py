"""Resumable uploads on disk: a push's body arriving in chunks, kept across broken connections and restarts.

Each open upload is two files under ``<data dir>/uploads``: ``<id>.part`` (the bytes received so far)
and ``<id>.json`` (what the push is: expert, owner, update metadata, size, SHA-256, and the offset
acknowledged so far). A chunk is written after the acknowledged offset, fsynced, and only then is the
new offset written (atomically, fsynced): an acknowledged offset is durable, and on restart the
``.part`` file is cut back to it (bytes of a chunk that was never acknowledged are dropped).

The digest of the received prefix is kept in memory as the chunks arrive, so finishing needs no
second read of the body; after a restart it is rebuilt once from the file.

A chunk usually never touches a spool file: the front asks where it goes before reading it (``place_chunk``,
through coordinator/api/upload_placement.py), writes it into ``<id>.part`` at the offset as it arrives and feeds it to a
copy of the running digest; ``write`` then checks the chunk's digest, fsyncs and acknowledges. Until then the
upload's lock is held and nothing past the acknowledged offset counts; a chunk that did not arrive whole or was
refused is cut off again when the front releases the place.

Bounds (coordinator/storage/upload_limits.py): an open reserves no disk, only a record; a principal keeps at most
``per_owner`` uploads open (opening one more evicts its least recently used), all principals together
``max_open`` (an open evicts the longest idle, never one that received a chunk in the last minute, else 507);
an upload idle for ``idle_seconds`` expires and its files are removed (swept whenever an upload is opened, and
at start). An upload is only opened if the disk could hold its body now (else 507, nothing recorded).
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from coordinator.storage.blobs import storage_errors
from coordinator.storage.incoming import BodyPlace, SpooledBody
from coordinator.storage.upload_chunks import (ChunkPlace, check_prefix, check_prefix_algorithm, copy_file_hashing,
                                               copy_stream, spool_usable)
from coordinator.storage.upload_limits import UploadLimits, global_evictions, is_expired, own_evictions
from coordinator.storage.upload_record import UPLOAD_ID_RE, Upload
from protocol.errors import BadRequest, Conflict, FedMoEError, InsufficientStorage, NotFound, Unavailable
from protocol.files import private_dir, write_atomically
from protocol.integrity import Readable, algorithm_of, content_id, new_hasher
from protocol.schemas import UpdateMeta

log = logging.getLogger(__name__)

HASH_CHUNK = 1 << 20
LOCK_WAIT = 10.0  # seconds a request waits for an upload another request is writing, then 503 (``holding``)


class RangeNotSatisfiable(FedMoEError):
    """A chunk that starts after the received bytes (a gap) or reaches past the upload's size."""

    code, status = "range_not_satisfiable", 416


class UploadStore:
    """The open (and recently finished) uploads of one data dir."""

    def __init__(self, root: Path, limits: UploadLimits = UploadLimits(),
                 clock: Callable[[], float] = time.time) -> None:
        self.root = private_dir(root)
        self.limits = limits
        self.clock = clock
        self._uploads: dict[str, Upload] = {}
        self._guard = threading.Lock()  # the index; each upload's own lock guards its files
        self._opening = threading.Lock()  # two opens of one update_id at once must not make two uploads
        self._load()

    # files ----------------------------------------------------------------------

    def part(self, upload: Upload) -> Path:
        return self.root / f"{upload.upload_id}.part"

    def _record(self, upload: Upload) -> Path:
        return self.root / f"{upload.upload_id}.json"

    def _save(self, upload: Upload) -> None:
        write_atomically(self._record(upload), json.dumps(upload.to_json()).encode())

    def _remove_files(self, upload: Upload) -> None:
        self._record(upload).unlink(missing_ok=True)
        self.part(upload).unlink(missing_ok=True)

    def _load(self) -> None:
        """Reopen the uploads a previous run left; cut each body back to its acknowledged offset."""
        for path in sorted(self.root.iterdir()):
            if path.name.startswith(".") or path.suffix not in (".json", ".part"):  # write_atomically leftovers
                path.unlink(missing_ok=True)
            elif path.suffix == ".json":
                try:
                    upload = Upload.from_json(json.loads(path.read_text()))
                except (OSError, ValueError, KeyError, TypeError, FedMoEError) as exc:
                    log.warning("dropping unreadable upload record %s: %s", path.name, exc)
                    path.unlink(missing_ok=True)
                    continue
                part = self.part(upload)
                if not upload.completed:
                    if not part.is_file() or part.stat().st_size < upload.offset:
                        log.warning("dropping upload %s: its body is shorter than acknowledged", upload.upload_id)
                        self._remove_files(upload)
                        continue
                    os.truncate(part, upload.offset)
                self._uploads[upload.upload_id] = upload
        for path in self.root.glob("*.part"):  # a body without a record: its open never completed
            if path.stem not in self._uploads:
                path.unlink(missing_ok=True)
        self.sweep()

    # lifecycle ------------------------------------------------------------------

    def sweep(self) -> None:
        """Remove uploads idle for longer than ``limits.idle_seconds`` (not those being written or finished)."""
        now = self.clock()
        with self._guard:
            stale = [u for u in self._uploads.values() if is_expired(u, now, self.limits)]
        for upload in stale:
            if self._drop(upload, blocking=False):
                log.info("upload %s of update %s expired at %d of %d bytes", upload.upload_id,
                         upload.meta.update_id, upload.offset, upload.size)

    def _drop(self, upload: Upload, blocking: bool = True) -> bool:
        if not upload.lock.acquire(blocking=blocking):
            return False
        try:
            with self._guard:
                self._uploads.pop(upload.upload_id, None)
            self._remove_files(upload)
            return True
        finally:
            upload.lock.release()

    def abandon(self, upload: Upload) -> None:
        with self.holding(upload):
            self.discard(upload)

    def open(self, expert: str, owner: str | None, meta: UpdateMeta, size: int, digest: str) -> tuple[Upload, bool]:
        """The upload of ``meta.update_id`` (new, or the one already open for it); (upload, created)."""
        self.sweep()
        with self._opening:
            return self._open(expert, owner, meta, size, digest)

    def _open(self, expert: str, owner: str | None, meta: UpdateMeta, size: int, digest: str) -> tuple[Upload, bool]:
        with self._guard:
            existing = next((u for u in self._uploads.values() if u.meta.update_id == meta.update_id), None)
        if existing is not None:
            if (existing.expert, existing.owner, existing.size, existing.digest, existing.meta) != \
                    (expert, owner, size, digest, meta):
                raise Conflict(f"update_id {meta.update_id!r} already has an open upload with other metadata, "
                               "size or digest; a retry must describe the same body, a new update needs a new "
                               "update_id", update_id=meta.update_id)
            return existing, False
        with storage_errors(f"open an upload for update {meta.update_id!r}"):
            self._check_space(size)
        self._make_room(owner)
        now = self.clock()
        upload = Upload(secrets.token_hex(16), expert, owner, meta, size, digest, created_at=now, touched_at=now,
                        hasher=new_hasher(algorithm_of(digest)))
        with storage_errors(f"open an upload for update {meta.update_id!r}"):
            try:
                self.part(upload).touch(mode=0o600)
                self._save(upload)
            except BaseException:
                self._remove_files(upload)
                raise
        with self._guard:
            self._uploads[upload.upload_id] = upload
        return upload, True

    def _make_room(self, owner: str | None) -> None:
        """Evict the owner's least recently used uploads until it may open one more, then, at the limit of all
        principals' uploads, the longest idle ones (coordinator/storage/upload_limits.py)."""
        with self._guard:
            open_uploads = [u for u in self._uploads.values() if not u.completed]
        mine = [u for u in open_uploads if owner is not None and u.owner == owner]
        for upload in own_evictions(mine, self.limits):
            if not self._drop(upload, blocking=False):
                raise Conflict(f"{_principal(owner)} already has {len(mine)} uploads open (the limit), and they are "
                               "being written; finish one first, or push in one request", reason="too_many_uploads")
            open_uploads.remove(upload)
            log.info("%s opened more than %d uploads: evicted upload %s of update %s", _principal(owner),
                     self.limits.per_owner, upload.upload_id, upload.meta.update_id)
        self._evict_idlest(open_uploads)

    def _evict_idlest(self, open_uploads: list[Upload]) -> None:
        """At ``max_open``, drop the longest idle uploads to make room for one more; 507 if not enough may go."""
        now = self.clock()
        evict = global_evictions(open_uploads, now, self.limits)
        if evict is None or not all(self._drop(upload, blocking=False) for upload in evict):
            raise InsufficientStorage(
                f"the coordinator holds {len(open_uploads)} open uploads (its limit) and each received a chunk in "
                f"the last {self.limits.protected_seconds:g} s; push the update in one request, or open the upload "
                "again later", reason="too_many_uploads")
        for upload in evict:
            log.info("%d uploads open (the limit): evicted upload %s of update %s, idle %.0f s", len(open_uploads),
                     upload.upload_id, upload.meta.update_id, now - upload.touched_at)

    def _check_space(self, size: int) -> None:
        """Whether the disk could hold this body now. Nothing is reserved (other uploads' missing bytes are not
        counted): an upload takes the space its received chunks take, and a chunk the disk cannot hold is a 507."""
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize
        if free < size:
            raise InsufficientStorage(f"the coordinator's disk cannot hold an upload of {size} bytes ({free} bytes "
                                      "free); nothing was recorded. Free space in its --data-dir, then send it again")

    @contextmanager
    def holding(self, upload: Upload) -> Iterator[Upload]:
        """The upload's lock, once no one else holds it; NotFound if it expired or was dropped meanwhile.

        Waits at most ``LOCK_WAIT`` s, then 503: a chunk being written in place (``place_chunk``) holds the lock
        until its request has run on a request thread, so requests waiting here without bound (retries of one
        upload on many connections) could take every request thread and that chunk would never be released."""
        if not upload.lock.acquire(timeout=LOCK_WAIT):
            raise Unavailable(f"upload {upload.upload_id} is being written by another request (a chunk still "
                              "arriving); ask for its offset and retry", retry_after=1, offset=upload.offset)
        try:
            with self._guard:
                live = self._uploads.get(upload.upload_id) is upload
            if not live:
                raise NotFound(f"upload {upload.upload_id} expired or was dropped; open a new one")
            yield upload
        finally:
            upload.lock.release()

    def get(self, upload_id: str, expert: str, caller: str | None) -> Upload:
        """The upload, if ``caller`` (its owner key, ``Upload.owner``; None for the admin) may use it; else NotFound
        (also for another principal's upload: whether an id exists is not told)."""
        with self._guard:
            upload = self._uploads.get(upload_id) if UPLOAD_ID_RE.fullmatch(upload_id) else None
        expired = upload is not None and is_expired(upload, self.clock(), self.limits)
        if upload is None or expired or upload.expert != expert or caller not in (None, upload.owner):
            raise NotFound(f"no open upload {upload_id!r} for expert {expert!r} (finished, expired after "
                           f"{self.limits.idle_seconds:g} s idle, or never opened); open a new one")
        return upload

    # chunks ---------------------------------------------------------------------

    def place_chunk(self, upload: Upload, start: int, length: int, hash_body: bool = True) -> BodyPlace | None:
        """Where the front writes a chunk of ``length`` bytes at ``start`` as it arrives: the upload's own file at the
        offset, with a copy of the running digest to feed. The upload's lock is held from now until the front
        releases the place (``ChunkPlace.release``). None when the chunk cannot go there now (another request is
        writing the upload, it is finished or gone, the chunk does not start at the offset or does not fit): it is
        then spooled, and ``write`` answers it as usual. ``hash_body``: whether the chunk's own digest is needed
        (it was sent with one), besides the running digest."""
        if length < 1 or not upload.lock.acquire(blocking=False):
            return None
        try:
            with self._guard:
                live = self._uploads.get(upload.upload_id) is upload
            if not live or upload.completed or start != upload.offset or start + length > upload.size:
                upload.lock.release()
                return None
            chunk = ChunkPlace(self, upload, start, length, self._hasher(upload).copy())
        except BaseException:
            upload.lock.release()
            raise
        return BodyPlace(chunk.file, self.part(upload), start, chunk.release, (chunk.hasher,), chunk, hash_body)

    def write(self, upload: Upload, start: int, stream: Readable, length: int, chunk_digest: str | None,
              spooled: SpooledBody | None = None, prefix_digest: str | None = None) -> None:
        """Append ``length`` bytes read from ``stream`` at ``start`` (which must be the offset); durable on return.

        ``chunk_digest`` is the chunk's own digest, ``prefix_digest`` that of the body's bytes up to the chunk's end
        (protocol/uploads.py PREFIX_DIGEST_HEADER, checked against the upload's running digest: no hash of its own);
        either or both may be given.

        ``spooled``: the front already wrote the chunk to a file and hashed it on the way in; then its digest
        stands for the chunk's. If that file is the upload's own (``place_chunk``), the chunk is only checked and
        made durable; else the file is copied in the kernel while one thread hashes it into the upload's running
        digest (one read of the chunk instead of a read, a write and two hashes in Python).
        """
        place = spooled.place.key if spooled is not None and spooled.place is not None else None
        if isinstance(place, ChunkPlace) and place.upload is upload:  # its lock is held by the place
            assert spooled is not None
            place.commit(start, length, spooled, chunk_digest, prefix_digest)
            return
        with self.holding(upload):
            self._check_start(upload, start, length)
            check_prefix_algorithm(upload, prefix_digest)
            hasher = self._hasher(upload).copy()
            part = self.part(upload)
            with storage_errors(f"store a chunk of upload {upload.upload_id}"):
                try:
                    with open(part, "r+b") as out:
                        if spool_usable(spooled, length, chunk_digest):
                            assert spooled is not None  # spool_usable says so
                            received = spooled.digest
                            copy_file_hashing(spooled.path, out, start, length, hasher)
                        else:
                            chunk_algorithm = algorithm_of(chunk_digest) if chunk_digest is not None else "sha256"
                            chunk_hash = new_hasher(chunk_algorithm)
                            out.seek(start)
                            copy_stream(stream, out, length, (hasher, chunk_hash))
                            received = content_id(chunk_algorithm, chunk_hash.hexdigest())
                        if chunk_digest is not None and received != chunk_digest:
                            raise BadRequest("the chunk does not match its digest: it was damaged on the way; "
                                             "send it again", reason="chunk_digest_mismatch", offset=upload.offset)
                        check_prefix(upload, hasher, prefix_digest)
                        out.flush()
                        os.fsync(out.fileno())
                    touched = self.clock()
                    self.save_offset(upload, start + length, touched)
                except BaseException:
                    os.truncate(part, upload.offset)  # nothing past the acknowledged offset stays
                    raise
            upload.offset, upload.touched_at, upload.hasher = start + length, touched, hasher

    def _check_start(self, upload: Upload, start: int, length: int) -> None:
        if upload.completed:
            raise Conflict(f"upload {upload.upload_id} is finished", reason="upload_complete", offset=upload.offset)
        if start + length > upload.size:
            raise RangeNotSatisfiable(f"the chunk ends at byte {start + length} of an upload of {upload.size} bytes",
                                      reason="past_end", offset=upload.offset)
        if start > upload.offset:
            raise RangeNotSatisfiable(f"the chunk starts at byte {start} but only {upload.offset} bytes were "
                                      "received: send the bytes from the offset", reason="offset_mismatch",
                                      offset=upload.offset)
        if start < upload.offset:
            raise Conflict(f"the chunk starts at byte {start}, before the {upload.offset} bytes already received "
                           "(chunks must not overlap): send the bytes from the offset", reason="offset_mismatch",
                           offset=upload.offset)

    def save_offset(self, upload: Upload, offset: int, touched: float) -> None:
        record = upload.to_json() | {"offset": offset, "touched_at": touched}
        write_atomically(self._record(upload), json.dumps(record).encode())

    def _hasher(self, upload: Upload) -> Any:
        """The digest state of the received prefix, in the upload's algorithm (rebuilt from the file once after a
        restart)."""
        if upload.hasher is None:
            hasher = new_hasher(algorithm_of(upload.digest))
            with open(self.part(upload), "rb") as f:
                while block := f.read(HASH_CHUNK):
                    hasher.update(block)
            upload.hasher = hasher
        return upload.hasher

    # finishing ------------------------------------------------------------------

    def received_digest(self, upload: Upload) -> str:
        """The content id of every byte received, in the upload's algorithm (call with the upload's lock held)."""
        return content_id(algorithm_of(upload.digest), self._hasher(upload).hexdigest())

    def mark_completed(self, upload: Upload) -> None:
        """The push ran: keep a small record to answer a retried finish, drop the body (lock held)."""
        upload.completed, upload.touched_at, upload.hasher = True, self.clock(), None
        try:
            self._save(upload)
            self.part(upload).unlink(missing_ok=True)
        except OSError as exc:  # the push is recorded either way; a stale .part only costs space until it expires
            log.warning("could not mark upload %s finished: %s", upload.upload_id, exc)

    def discard(self, upload: Upload) -> None:
        """Remove an upload whose push was refused (lock held): resending the same bytes cannot succeed."""
        with self._guard:
            self._uploads.pop(upload.upload_id, None)
        self._remove_files(upload)

    def open_count(self) -> int:
        with self._guard:
            return sum(not u.completed for u in self._uploads.values())


def _principal(owner: str | None) -> str:
    """An owner key as the operator reads it: "worker 'w1'", "relay 'site-a'"."""
    kind, _, name = (owner or "").rpartition(":")
    return f"{kind or 'worker'} {name!r}"
