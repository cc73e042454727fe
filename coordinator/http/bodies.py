"""Large request bodies on their way in, for the buffering front (coordinator/http/front.py).

The request cycle (coordinator/http/connection.py) reads the rest of a body straight from the socket into two
buffers of a ``BufferBudget`` in turn (``Wire.fill``), or has a body thread read it (``read_on_thread``);
``Spool`` writes a body's chunks to a named file in the blob store's temp dir and hashes them, on a
thread, one chunk behind the socket; the application finds the result as a ``SpooledBody`` and may
take the file over instead of copying it (issue 18, docs/scale.md). When the application says where a
body belongs before it arrives (a ``BodyPlace``: a resumable upload's chunk goes into its upload's file),
the spool writes it there instead, so it is never copied again (docs/scale.md, seventh round).
"""
from __future__ import annotations

import asyncio
import errno
import mmap
import os
import socket
import struct
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from coordinator.http.heads import HttpError
from coordinator.storage.incoming import BodyPlace, SpooledBody
from protocol.integrity import content_id, new_hasher

DIRECT_CHUNK = 1 << 20  # each of a large body's two receive buffers; also one piece of a body read on a thread
BUFFER_BUDGET = 12  # DIRECT_CHUNK buffers large bodies hold at once, plus the free ones kept for the next
Buffer = bytearray | mmap.mmap


def new_buffer(size: int) -> Buffer:
    """A zeroed receive buffer whose pages cost memory only once written: a client that announces a large body and
    then sends a byte now and then (bench/hostile.py, 333 such) holds a page, not 1 MiB (``bytearray(size)`` writes
    every page at once: +690 MiB of RSS in that benchmark)."""
    return mmap.mmap(-1, size) if size else bytearray(0)


class BufferBudget:
    """The receive buffers of large bodies in flight, and the free ones kept for the next: at most ``budget`` of
    them, held by large bodies (each keeps its two for as long as a client stalls, up to --socket-timeout) and the
    free list together; past it a body is read through the connection's bounded pending bytes (slower, no larger).
    Before (audit F10), every stalled large body held two written 1 MiB buffers: 100 of them, 200 MiB. A body
    thread's buffer is outside the budget (``bounded=False``): BODY_THREADS bound those, and a thread gives its
    buffer back after THREAD_STALL without progress. Used on the event loop only."""

    def __init__(self, budget: int = BUFFER_BUDGET, size: int = DIRECT_CHUNK) -> None:
        self.budget, self.size = budget, size
        self.free: list[Buffer] = []
        self.out = 0

    def take(self, n: int, bounded: bool = True) -> list[Buffer] | None:
        """``n`` buffers (pages already written, if reused), or None when that would go over the budget."""
        if bounded and self.out + n > self.budget:
            return None
        self.out += n
        reused = [self.free.pop() for _ in range(min(n, len(self.free)))]
        return reused + [new_buffer(self.size) for _ in range(n - len(reused))]

    def give_back(self, buffers: list[Buffer], reuse: bool = True) -> None:
        """Return buffers from ``take``; ``reuse`` only when nothing reads or writes them any more (else they are
        dropped, and unmapped once the last view of them goes)."""
        self.out -= len(buffers)
        if reuse:
            self.free.extend(buffers[:max(0, self.budget - self.out - len(self.free))])


class Spool:
    """A body being written to a named file in ``directory`` (or into a ``BodyPlace``) and hashed, on threads side by
    side, one chunk behind the socket."""

    def __init__(self, directory: Path, algorithm: str, size_hint: int, hashing: ThreadPoolExecutor,
                 place: BodyPlace | None = None) -> None:
        self.directory = directory
        self.place = place
        self.path: Path | None = None if place is None else place.path
        self._file: IO[bytes] | None = None if place is None else place.file
        self._opening = threading.Lock()  # the file is made by whichever thread writes first; discard may race it
        self.discarded = False
        self.algorithm, self.hasher, self.hashing = algorithm, new_hasher(algorithm, size_hint), hashing
        self.hashers = (self.hasher,) if place is None else (self.hasher,) * place.hash_body + place.hashers
        self.pending: list[asyncio.Future] = []
        self.jobs: list[Future] = []  # the threads' jobs behind ``pending`` (a cancelled wait does not stop them)
        self.spooled: SpooledBody | None = None
        self._input: IO[bytes] | None = None

    @property
    def file(self) -> IO[bytes]:
        """The spool file, made on first use (its mkstemp off the event loop when a thread writes first)."""
        with self._opening:
            if self._file is None:
                if self.discarded:
                    raise ConnectionAbortedError("the request was given up while its body arrived")
                try:
                    fd, name = tempfile.mkstemp(dir=self.directory, suffix=".part")
                except OSError as exc:
                    raise_if_full(exc)
                    raise
                self.path, self._file = Path(name), open(fd, "w+b")
            return self._file

    async def feed(self, chunk: bytes | memoryview) -> None:
        """Write ``chunk`` on one thread and hash it on another after the previous one, without waiting for
        them: the loop reads the next meanwhile, and never waits for the disk itself (a write into the page
        cache can sleep for milliseconds when the kernel throttles dirty pages, and the loop serves every
        connection). Both release the GIL, so a body spools at the slower one's rate, not their sum's."""
        await self.drain()
        self.jobs = [self.hashing.submit(self._write, chunk), *(self.hashing.submit(h.update, chunk) for h in self.hashers)]
        self.pending = [asyncio.wrap_future(job) for job in self.jobs]

    def _write(self, chunk: bytes | memoryview) -> None:
        write_chunk(self.file, chunk)

    def absorb(self, chunk: bytes | memoryview) -> None:
        """Write and hash ``chunk`` here and now (on a body thread, ``read_on_thread``); nothing may be pending."""
        write_chunk(self.file, chunk)
        for h in self.hashers:
            h.update(chunk)

    async def drain(self) -> None:
        """Wait until every chunk fed so far is written and hashed (HttpError 507 if the disk is full)."""
        outcomes = await asyncio.gather(*self.pending, return_exceptions=True)  # all done: the chunk's buffer is free
        self.pending, self.jobs = [], []  # (kept while waiting: a request cancelled here still releases a place after them)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def finish(self, size: int) -> SpooledBody:
        await self.drain()
        self.file.flush()
        assert self.path is not None  # made with the file
        hashed = self.place is None or self.place.hash_body
        self.spooled = SpooledBody(self.path, size, content_id(self.algorithm, self.hasher.hexdigest()) if hashed
                                   else "", place=self.place)
        return self.spooled

    def input(self) -> IO[bytes]:
        """The body for the application to read (``wsgi.input``), from its first byte."""
        if self.place is None:
            self.file.seek(0)
            return self.file
        assert self.path is not None  # the place's
        self._input = open(self.path, "rb")  # noqa: SIM115 - closed by discard
        self._input.seek(self.place.offset)
        return self._input

    def discard(self) -> None:
        """Close the file, and delete it unless the application took it (renamed it into its store); a place is
        given back to the application (``BodyPlace.release``) instead, once every write to it has ended."""
        if self.place is not None:
            self._release_place()
            return
        for pending in self.pending:  # a failed request: the threads' outcome no longer matters
            pending.add_done_callback(lambda f: f.cancelled() or f.exception())
        with self._opening:
            self.discarded = True
            if self._file is not None:
                self._file.close()
        if self.path is not None and (self.spooled is None or not self.spooled.taken):
            self.path.unlink(missing_ok=True)

    def _release_place(self) -> None:
        """Release the place once no thread writes into it any more (a failed request's writes may still be queued
        or running): the application's ``release`` cuts what was written and must not race a late write."""
        assert self.place is not None
        place, jobs, self.jobs, self.pending = self.place, self.jobs, [], []
        with self._opening:
            self.discarded = True
        if self._input is not None:
            self._input.close()
        left, lock = [len(jobs)], threading.Lock()

        def one_done(_: Any) -> None:  # on the thread that ran the job, or here if it is done already
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                place.release()

        if not jobs:
            place.release()
        for job in jobs:
            job.add_done_callback(one_done)


def read_on_thread(fd: int, spool: Spool, first: bytes, left: int, buffer: Buffer, stall: float) -> int:
    """On a body thread: spool ``first``, then up to ``left`` more bytes read from the socket ``fd`` with blocking
    ``recv_into(MSG_WAITALL)``, one ``buffer``-full at a time, each written and hashed before the next is read.

    One hand-off per body instead of the loop's wake-up per read and two thread hand-offs per MiB (docs/scale.md,
    sixth round). The caller has paused the transport's reading and has nothing left to write, so the loop does not
    touch the socket meanwhile; the socket is blocking only while this runs (O_NONBLOCK belongs to the file
    description, which the loop's fd shares), with ``stall`` s as its receive timeout. A piece that has not fully
    arrived after ``stall`` s ends the call early: a slow client costs a thread at most that long, and the loop
    reads the rest with its own stall timeout. Returns the bytes read from the socket (< ``left`` if it ended early);
    raises IncompleteReadError when the client closed the connection, OSError for a reset or (507) a full disk.
    """
    if first:
        spool.absorb(first)
    got = 0
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:  # out of file descriptors: the loop reads the body instead
        return 0
    try:
        sock.setblocking(True)
        seconds = max(stall, 0.001)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("ll", int(seconds), int((seconds % 1) * 1_000_000)))
        view = memoryview(buffer)
        while got < left:
            want = min(len(view), left - got)
            try:
                n = sock.recv_into(view, want, socket.MSG_WAITALL)
            except BlockingIOError:  # nothing at all for ``stall`` s
                break
            if n == 0:
                raise asyncio.IncompleteReadError(b"", left - got)
            spool.absorb(view[:n])
            got += n
            if n < want:  # the timeout, a signal or the end of the stream cut the piece short
                if _at_eof(sock):
                    raise asyncio.IncompleteReadError(b"", left - got)
                break  # a slow client: the loop takes over
        view.release()
    finally:
        sock.setblocking(False)
        sock.close()  # the dup; the connection stays open
    return got


def _at_eof(sock: socket.socket) -> bool:
    """Whether the peer has closed its side (nothing more will come), without waiting or consuming anything."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False


def write_chunk(body: IO[bytes], chunk: bytes | memoryview) -> None:
    try:
        body.write(chunk)
    except OSError as exc:
        raise_if_full(exc)
        raise


def raise_if_full(exc: OSError) -> None:
    if exc.errno == errno.ENOSPC:
        raise HttpError(507, "insufficient_storage", "the coordinator's disk is full; nothing was recorded, "
                        "try again later") from None
