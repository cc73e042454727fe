"""Resumable pushes, client side: a large body goes up in chunks and continues where a break left it.

A one-shot push that breaks at 90% sends the whole body again. Here the client opens an upload keyed by
the update_id (``POST /experts/<name>/uploads``), sends chunks with ``Content-Range`` (each acknowledged
once durable on the coordinator), and after a broken connection, a timeout or a 5xx asks where the
coordinator stands (``GET .../uploads/<id>``) and continues from there: a break costs at most the chunk
in flight. ``complete`` then runs the coordinator's one-shot push path, so the answer (and exactly-once
by update_id) is the same as a one-shot push's.

Chunks are sized from the measured rate to take about ``chunk_seconds`` each, and at most
``max_fraction`` of the body (within ``min_chunk``..``max_chunk``): few round trips on a fast link, and a
break costs at most ~2 s of transfer and 1/8 of the body.

The body is hashed once: the pass that computes its digest for the open keeps the digest's state every
``SNAPSHOT`` bytes, so each chunk's check (the digest of the body up to its end, ``PREFIX_DIGEST_HEADER``)
costs at most a snapshot's worth of hashing. Against a coordinator that does not offer that check, each chunk
is hashed on its own as before (``X-FedMoE-Digest``).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from protocol.errors import Conflict, FedMoEError, InsufficientStorage, NotFound, RequestTimeout, Unavailable
from protocol.integrity import DEFAULT_ALGORITHM, digest_header, new_hasher

log = logging.getLogger(__name__)

MiB = 1 << 20
SNAPSHOT = 4 * MiB  # the body digest's state is kept at every multiple of this (1 GiB: 256 small copies)
PREFIX_DIGEST_HEADER = "X-FedMoE-Upload-Digest"
"""A chunk's check, when the coordinator offers it (``"prefix_digests": true`` in its answer to the open): the
digest of the body from its first byte through the chunk's last, in the upload's algorithm. Both ends then hash
each byte once (the client while computing the body's digest, the coordinator into the upload's running digest)
instead of once more for the chunk's own ``X-FedMoE-Digest``."""


class UploadsUnsupported(Exception):
    """The coordinator has no upload routes (one older than the routes, root or relay): push in one request."""


class UploadRefused(UploadsUnsupported):
    """The coordinator would not open an upload now: no room on its disk for the body, or the open-upload limit
    (507 or 409 ``too_many_uploads``). A push in one request may still be taken: the client sends one."""


def refused_open(exc: FedMoEError) -> bool:
    """Whether an open's error means "no upload now" rather than "no such expert" or "bad request"."""
    return isinstance(exc, InsufficientStorage) or (isinstance(exc, Conflict)
                                                    and exc.details.get("reason") == "too_many_uploads")


@dataclass(frozen=True)
class UploadPolicy:
    threshold: int = 8 * MiB
    """Bodies of at least this many bytes are pushed resumably; smaller ones in one request."""
    first_chunk: int = 4 * MiB
    """Size of the first chunk, before any rate is measured."""
    min_chunk: int = 1 * MiB
    max_chunk: int = 128 * MiB
    """Largest chunk (on a fast link; a 1 GiB body is sent in 9 requests, not 17: each costs a round trip, a
    commit and a refill of the pipeline; docs/history/scale.md seventh round)."""
    chunk_seconds: float = 2.0
    """Later chunks are sized to take about this long at the rate measured so far."""
    max_fraction: float = 1 / 8
    """No chunk is larger than this fraction of the body (unless that is below min_chunk)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_chunk <= self.first_chunk <= self.max_chunk:
            raise ValueError(f"need 1 <= min_chunk <= first_chunk <= max_chunk, got {self.min_chunk}, "
                             f"{self.first_chunk}, {self.max_chunk}")
        if self.threshold < 1 or not self.chunk_seconds > 0 or not 0 < self.max_fraction <= 1:
            raise ValueError(f"need threshold >= 1, chunk_seconds > 0 and 0 < max_fraction <= 1, got "
                             f"{self.threshold}, {self.chunk_seconds}, {self.max_fraction}")


@dataclass
class UploadStats:
    """What one resumable push cost: body bytes sent (re-sent ones included), breaks recovered from, and where its
    time went (seconds by the push's clock)."""

    size: int = 0
    sent: int = 0
    chunks: int = 0
    resumes: int = 0
    reopened: int = 0
    open_seconds: float = 0.0
    """The body's digest and the first open (nothing is sent before both)."""
    chunk_seconds: float = 0.0
    """Chunks sent and acknowledged, in all (failed ones too)."""
    complete_seconds: float = 0.0
    """The finish: the coordinator's check, norm, record and fsync, until its answer."""

    @property
    def resent(self) -> int:
        return max(0, self.sent - self.size)


Call = Callable[..., Any]
"""``call(method, path, attempts=None, **requests_kwargs) -> requests.Response`` with the client's auth;
``attempts=1`` for a single try (no retry inside), None for the client's retry policy. A ``data`` body
is a memoryview of the chunk (the client sends it as protocol.client.bodies.Chunks)."""


@dataclass
class ResumablePush:
    call: Call
    expert: str
    body: bytes
    meta: dict[str, Any]
    policy: UploadPolicy
    attempts: int
    """Consecutive failures without progress before giving up (the client's RetryPolicy.attempts)."""
    backoff: Callable[[int], float]
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    stats: UploadStats = field(default_factory=UploadStats)
    algorithm: str = DEFAULT_ALGORITHM
    """Digest of the body and of each chunk (the client's; sha256 for a coordinator before 0.7)."""

    def _adopt(self, opened: dict[str, Any]) -> None:
        """Continue the upload the coordinator answered an open with (or nothing to send: ``update`` is set)."""
        self._done: dict[str, Any] | None = opened.get("update")
        self._upload_id: str | None = opened.get("upload_id")
        self._offset: int = int(opened["offset"])
        self._limit = max(self.policy.min_chunk, min(self.policy.max_chunk, int(len(self.body) * self.policy.max_fraction)))
        self._limit = min(self._limit, int(opened.get("chunk_limit") or self._limit))  # the coordinator's own bound
        self._prefix_digests = bool(opened.get("prefix_digests"))

    def run(self) -> dict[str, Any]:
        """Push the body; the coordinator's answer to the push (its UpdateStatus)."""
        self.stats.size = len(self.body)
        started = self.clock()
        try:
            opened = self._open()
        except NotFound as exc:  # no such route, or no such expert: the one-shot push tells which
            raise UploadsUnsupported(str(exc)) from None
        self.stats.open_seconds = self.clock() - started
        self._adopt(opened)
        chunk, failures = min(self.policy.first_chunk, self._limit), 0
        while self._done is None:
            try:
                started = self.clock()
                if self._offset < len(self.body):
                    n = self._chunk_size(chunk)
                    try:
                        self._offset = self._put(n)
                    finally:
                        seconds = self.clock() - started
                        self.stats.chunk_seconds += seconds
                    log.debug("chunk of %d bytes acknowledged at offset %d in %.3f s", n, self._offset, seconds)
                    chunk = self._next_chunk(n, seconds)
                else:
                    try:
                        self._done = self.call("POST", f"/experts/{self.expert}/uploads/{self._upload_id}/complete").json()
                    finally:
                        self.stats.complete_seconds += self.clock() - started
                failures = 0
                continue
            except FedMoEError as exc:
                failures = self._failed(exc, failures)
            self._resync()
        return self._done

    def _resync(self) -> None:
        """Ask where the coordinator stands; open the upload again if it is gone (expired, dropped)."""
        try:
            self._offset = int(self.call("GET", f"/experts/{self.expert}/uploads/{self._upload_id}").json()["offset"])
        except NotFound:  # the update_id still keeps the push exactly-once
            self.stats.reopened += 1
            self._adopt(self._open())

    @cached_property
    def digest(self) -> str:
        """The body's digest header; the pass keeps the digest's state at every multiple of SNAPSHOT bytes."""
        hasher, view, snapshots = new_hasher(self.algorithm, len(self.body)), memoryview(self.body), []
        for start in range(0, len(view), SNAPSHOT):
            hasher.update(view[start:start + SNAPSHOT])
            snapshots.append(hasher.copy())
        self._snapshots = snapshots[:len(view) // SNAPSHOT]  # [i]: the state after (i + 1) * SNAPSHOT bytes
        return f"{self.algorithm}={hasher.hexdigest()}"

    def _prefix_digest(self, end: int) -> str:
        """The digest header of body[:end], from the nearest snapshot at or before ``end``."""
        self.digest  # noqa: B018 - the snapshots are taken with it
        whole = end // SNAPSHOT
        hasher = self._snapshots[whole - 1].copy() if whole else new_hasher(self.algorithm)
        hasher.update(memoryview(self.body)[whole * SNAPSHOT:end])
        return f"{self.algorithm}={hasher.hexdigest()}"

    def _chunk_size(self, wanted: int) -> int:
        """``wanted`` bytes, the rest if less; a large chunk is cut to end on a snapshot (at most a quarter shorter)
        so that its prefix digest costs no hashing. A small one is not (a slow link's 1 MiB chunks would double in
        number), and its prefix digest hashes at most SNAPSHOT bytes more."""
        left = len(self.body) - self._offset
        if wanted >= left:
            return left
        if wanted < 4 * SNAPSHOT:
            return wanted
        return (self._offset + wanted) // SNAPSHOT * SNAPSHOT - self._offset

    def _open(self) -> dict[str, Any]:
        """Open (or find) the upload; UploadRefused when the coordinator has no room for one now."""
        try:
            return self.call("POST", f"/experts/{self.expert}/uploads",
                             json={"update": self.meta, "size": len(self.body), "digest": self.digest}).json()
        except FedMoEError as exc:
            if refused_open(exc):
                raise UploadRefused(str(exc)) from None
            raise

    def _put(self, n: int) -> int:
        offset = self._offset
        view = memoryview(self.body)[offset:offset + n]
        self.stats.sent += n
        self.stats.chunks += 1
        check = {PREFIX_DIGEST_HEADER: self._prefix_digest(offset + n)} if self._prefix_digests else \
            {"X-FedMoE-Digest": digest_header(view, self.algorithm)}
        r = self.call("PUT", f"/experts/{self.expert}/uploads/{self._upload_id}", attempts=1, data=view,
                      headers={"Content-Range": f"bytes {offset}-{offset + n - 1}/{len(self.body)}",
                               "Content-Type": "application/octet-stream"} | check)
        return int(r.json()["offset"])

    def _failed(self, exc: FedMoEError, failures: int) -> int:
        """Count a failure that made no progress; re-raise what waiting cannot fix, or the last one."""
        retryable = isinstance(exc, (Unavailable, RequestTimeout, NotFound)) or "offset" in exc.details
        # (NotFound: the upload expired; "offset": a chunk or a finish that does not fit what was received)
        if not retryable:
            raise exc
        failures += 1
        if failures >= self.attempts:
            raise Unavailable(f"push of update {self.meta.get('update_id')!r} kept failing ({exc}); gave up after "
                              f"{failures} tries without progress") from None
        self.stats.resumes += 1
        log.info("push of update %s interrupted (%s); asking the coordinator where to continue",
                 self.meta.get("update_id"), exc)
        self.sleep(self.backoff(failures - 1))
        return failures

    def _next_chunk(self, n: int, seconds: float) -> int:
        wanted = int(n / max(seconds, 1e-3) * self.policy.chunk_seconds)
        return min(self._limit, max(self.policy.min_chunk, wanted))
