"""The coordinator's HTTP server: an asyncio front that buffers whole requests before a thread runs Flask.

Why not gunicorn's threaded worker (used until issue 13): its request threads read request heads
and bodies themselves, so 16 clients dripping one header line every few seconds (plain or TLS)
held all 16 threads and every other client waited (issue 13, defect 2). Here one event loop owns
every connection: TLS handshakes, heads, bodies (spooled to an unlinked file in the data dir past
1 MiB, never RAM) and the writing of answers all happen in the loop, and a request thread runs
the application only once its request is complete, and returns as soon as the answer is built.
Files (weight pulls) are sent by the loop with sendfile; a slow reader costs a socket, not a thread.
Measured (bench/hostile.py, docs/benchmarks.md): 1,000 slow connections, /health p99 well under 1 s.

A body over 1 MiB is written as it arrives to a named file in ``spool_dir`` (the blob store's temp
dir) and hashed on the way (the algorithm the client's X-FedMoE-Digest names, BLAKE3 by default) on
a hashing thread that overlaps the next read. The application finds it as ``environ[SPOOLED_BODY]``
and may take the file over (rename it into the store) instead of copying the body again: the copy
and the second hashing pass were a third of a 1 GiB push (issue 18, docs/scale.md). An application that
knows where a body belongs before it arrives (``FrontOptions.placer``: a resumable upload's chunk goes
into its upload's file) gets it written there instead of a spool file, and copies nothing.

--socket-timeout keeps its meaning: a connection whose head, body or answer makes no progress for
that long is dropped (a stalled body is answered 408 first).
"""
from __future__ import annotations

import asyncio
import asyncio.sslproto
import io
import logging
import os
import re
import resource
import signal
import socket
import ssl
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, Protocol, cast

from protocol.integrity import DIGEST_HEADER, requested_algorithm
from coordinator.front_bodies import BodyPlace, BufferBudget, DirectBody, Spool, read_on_thread, write_chunk
from coordinator.http1 import HEAD_LIMIT, HttpError, RequestHead, error_response, parse_head, response_head, \
    wsgi_environ

log = logging.getLogger(__name__)
# asyncio's TLS protocol gives each connection a 256 KiB read buffer: 1,000 idle TLS clients cost
# 300 MiB of RSS (bench/hostile.py). 64 KiB still reads whole TLS records (16 KiB) several at a time.
asyncio.sslproto.SSLProtocol.max_size = 64 << 10
CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")  # a chunk size: hex digits only (RFC 9112 7.1), at most 64 bits
SPOOL_IN_MEMORY = 1 << 20  # request bodies up to this stay in memory; larger ones go to disk
READ_CHUNK = 1 << 20
STREAM_READ = 64 << 10  # bytes a connection's stream reads from its socket at once
DIRECT_FROM = 256 << 10  # bodies from this size on are read straight into buffers (DirectBody)
BODY_THREADS = 64  # threads that read a spooled body with blocking receives (read_on_thread); when all are busy, the loop reads
THREAD_BODY_MAX = 16 << 20  # larger bodies stay on the loop, whose receive, write and hash of a body overlap
THREAD_STALL = 2.0  # seconds a body thread waits for a piece before the loop takes the connection back
SEND_CHUNK = 1 << 20  # one stall-timeout step of an answer: a client slower than this per timeout is dropped
SENDFILE_CHUNK = 4 << 20  # the same for files: fewer steps, so pulls run near gunicorn's sendfile rate
LINGER_SECONDS = 5.0  # how long an answer sent before its request's body is followed by reading and dropping that body
GRACE_SECONDS = 10.0  # on SIGTERM, how long requests being answered get to finish

WsgiApp = Callable[[dict[str, Any], Callable], Iterable[bytes]]
ADMISSION_MARKS = "fedmoe."
"""environ keys an ``Admission`` sets on the head's environ that the request's own environ gets too (e.g. that its
rate-limit token is taken: coordinator/auth.py, RATE_TAKEN); no request header can make such a key."""
SPOOLED_BODY = "fedmoe.spooled_body"
"""environ key of a ``SpooledBody`` (bodies over SPOOL_IN_MEMORY when a spool_dir is set)."""


class BodyPlacer(Protocol):
    """Where the application wants some large bodies written as they arrive (coordinator/upload_place.py)."""

    def wants(self, method: str, path: str) -> bool:
        """Whether to ask ``place`` for this request (on the event loop: must be cheap and never block)."""

    def place(self, environ: dict[str, Any]) -> BodyPlace | None:
        """On a request thread, before the body is read (``environ`` has the head, an empty ``wsgi.input``): a place
        for the body, or None to spool it as usual (the application then answers as it would have)."""


class Admission(Protocol):
    """What the application answers from a request's head alone (coordinator/admission.py), asked before a body
    the front would spool (over SPOOL_IN_MEMORY, or chunked) is read: a client without a token, or over the route's
    own limit, costs no disk and no wait for its body (audit F9)."""

    def admit(self, environ: dict[str, Any]) -> Answer | None:
        """On a request thread (``environ`` has the head, an empty ``wsgi.input``): None to read the body and run the
        request as usual, or the answer to send instead; the front then closes the connection (the body is unread).
        Keys it adds to ``environ`` under ADMISSION_MARKS reach the request's own environ."""


@dataclass(frozen=True)
class FrontOptions:
    threads: int = 16
    """Request threads: requests whose application code runs at once."""
    socket_timeout: float = 60.0
    """Seconds a connection may make no progress (head, body or answer) before it is dropped."""
    keepalive: float = 30.0
    """Seconds an idle kept-alive connection stays open."""
    max_body: int = 1 << 30
    """Largest request body; a larger Content-Length is answered 413 before any of it is read."""
    max_body_flag: str = "coordinator flag --max-body-mb"
    """Where the 413 tells the client the limit comes from."""
    spool_dir: Path | None = None
    """Where bodies over 1 MiB are spooled (unlinked files); None = the system temp dir."""
    max_connections: int = 10_000
    """Connections held at once; more are closed at accept."""
    placer: BodyPlacer | None = None
    """Writes some spooled bodies where the application wants them instead (needs ``spool_dir``)."""
    admission: Admission | None = None
    """Refuses requests from their head before a large body is read."""
    tls_cert: Path | None = None
    """PEM certificate (chain): serve HTTPS (``coordinator.http.serve`` makes the TLS context from it)."""
    tls_key: Path | None = None
    """PEM private key of ``tls_cert``."""


class FileBody:
    """``wsgi.file_wrapper``: lets the loop send a file (sendfile) instead of a thread iterating it."""

    def __init__(self, filelike: BinaryIO, block_size: int = 8192) -> None:
        self.filelike, self.block_size = filelike, block_size

    def __iter__(self):  # WSGI middleware that iterates still gets the bytes
        while block := self.filelike.read(self.block_size):
            yield block

    def close(self) -> None:
        self.filelike.close()


@dataclass
class Answer:
    status: str
    headers: list[tuple[str, str]]
    chunks: list[bytes]
    file: FileBody | None = None
    stream: StreamedBody | None = None
    """The rest of an answer of unknown length (no Content-Length: server-sent events), pulled chunk by chunk."""


class StreamedBody:
    """An application's answer iterator whose chunks the loop sends as they come (chunked transfer coding), each
    pulled on a request thread: a thread waits for the application (e.g. for the next generated token), never for
    the client, and the next chunk is pulled only once the last one is written (a slow reader holds it back)."""

    def __init__(self, chunks: Iterator[bytes], result: Iterable[bytes]) -> None:
        self.chunks, self.result = chunks, result

    def next_chunk(self) -> bytes | None:
        """On a request thread: the next non-empty chunk, None at the end."""
        return next((chunk for chunk in self.chunks if chunk), None)

    def close(self) -> None:
        """On a request thread, never while ``next_chunk`` runs: the application's clean-up (a client gone mid-stream
        stops its generation here, GeneratorExit in the app's generator)."""
        if hasattr(self.result, "close"):
            self.result.close()


def raise_fd_limit() -> int:
    """Raise the soft open-files limit to the hard one (each connection is an fd); return the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


class BufferingFront:
    """Serve one WSGI app on an already bound, listening socket until SIGTERM or SIGINT."""

    def __init__(self, app: WsgiApp, sock: socket.socket, options: FrontOptions,
                 tls: ssl.SSLContext | None = None) -> None:
        self.app, self.sock, self.options, self.tls = app, sock, options, tls
        self.scheme = "https" if tls else "http"
        self.pool = ThreadPoolExecutor(options.threads, thread_name_prefix="fedmoe-request")
        # spooled bodies: the write, the body's digest and a place's own digest (an upload's running one) side by side
        self.hashing = ThreadPoolExecutor(3, thread_name_prefix="fedmoe-hash")
        self.bodies = ThreadPoolExecutor(BODY_THREADS, thread_name_prefix="fedmoe-body")
        self.free_body_threads = BODY_THREADS
        self.bodies_read = {"thread": 0, "loop": 0}  # large bodies by who read them (all, or the loop at least part)
        self.buffers = BufferBudget()  # the receive buffers of DirectBody and the body threads
        self.connections: set[asyncio.Task] = set()
        self.busy = 0  # requests inside the application right now
        self.stopping: asyncio.Event | None = None

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        self.sock.setblocking(False)
        server = await asyncio.start_server(self._accept, sock=self.sock, ssl=self.tls, limit=HEAD_LIMIT,
                                            ssl_handshake_timeout=self.options.socket_timeout if self.tls else None)
        await self.stopping.wait()
        server.close()  # stop accepting; requests being answered get GRACE_SECONDS
        deadline = loop.time() + GRACE_SECONDS
        while self.busy and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for task in list(self.connections):
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.hashing.shutdown(wait=False, cancel_futures=True)
        self.bodies.shutdown(wait=False, cancel_futures=True)
        log.info("front: %d large bodies read on body threads, %d by the event loop (at least in part)",
                 self.bodies_read["thread"], self.bodies_read["loop"])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.connections) >= self.options.max_connections:
            writer.close()
            return
        no_delay(writer.get_extra_info("socket"))
        small_reads(writer)
        task = asyncio.current_task()
        assert task is not None  # start_server runs each connection's callback in a task of its own
        self.connections.add(task)
        try:
            await Connection(self, reader, writer).serve()
        except asyncio.CancelledError:
            pass
        finally:
            self.connections.discard(task)
            writer.close()

    async def call_app(self, environ: dict[str, Any]) -> Answer:
        self.busy += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, self._call_app, environ)
        finally:
            self.busy -= 1

    def _call_app(self, environ: dict[str, Any]) -> Answer:
        """In a request thread: run the app and collect its answer (a file is left for the loop to send)."""
        answer = Answer("500 Internal Server Error", [], [])

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable:
            answer.status, answer.headers = status, list(headers)
            return answer.chunks.append

        result = self.app(environ, start_response)
        if type(result) is FileBody:
            if _has_fileno(result.filelike):
                answer.file = result
                return answer
            try:  # an in-memory file (send_file(io.BytesIO(...))): its bytes, as one chunk (sendfile needs a fd)
                answer.chunks.append(result.filelike.read())
            finally:
                result.close()
            return answer
        chunks, streamed = iter(result), False
        try:
            first = next((chunk for chunk in chunks if chunk), None)  # start_response has been called after it
            if first is not None:
                answer.chunks.append(first)
                if not isinstance(result, (list, tuple)) and _of_unknown_length(answer, environ):
                    answer.stream, streamed = StreamedBody(chunks, result), True
                    return answer
            answer.chunks.extend(chunk for chunk in chunks if chunk)
        finally:
            if not streamed and hasattr(result, "close"):
                result.close()
        return answer


class Connection:
    """One client connection: read a whole request, let a thread answer it, write the answer; repeat."""

    def __init__(self, front: BufferingFront, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.front, self.reader, self.writer = front, reader, writer
        self.timeout = front.options.socket_timeout
        self.peer = writer.get_extra_info("peername")
        self.server = writer.get_extra_info("sockname")

    async def serve(self) -> None:
        first = True
        assert self.front.stopping is not None  # set before the server accepts connections
        try:
            while not self.front.stopping.is_set():
                head = await self._read_head(self.timeout if first else self.front.options.keepalive)
                if head is None:
                    return
                first = False
                if not await self._exchange(head):
                    return
        except HttpError as exc:
            await self._send_error(exc)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            log.debug("dropped a connection from %s that stalled or went away", self.peer)
        except OSError as exc:
            log.debug("connection from %s failed: %s", self.peer, exc)
        except Exception:  # noqa: BLE001 - a bug in the server itself: answer 500, keep serving others
            log.exception("unhandled error serving %s (a bug)", self.peer)
            await self._send_error(HttpError(500, "internal", "internal error; see the coordinator log"))

    async def _read_head(self, timeout: float) -> RequestHead | None:
        """The next request head, None at a clean end; the whole head must arrive within ``timeout``."""
        try:
            async with asyncio.timeout(timeout):  # no task per call, unlike wait_for (3.11)
                raw = await self._read_raw_head()
        except asyncio.IncompleteReadError as exc:
            if exc.partial.strip():
                raise
            return None
        except asyncio.LimitOverrunError:
            raise HttpError(431, "request_header_fields_too_large",
                            f"request line and headers are over {HEAD_LIMIT} bytes") from None
        return parse_head(raw)

    async def _read_raw_head(self) -> bytes:
        first = await self.reader.readexactly(1)
        # A request starts with a method (letters; an empty line before it is allowed). Anything else,
        # e.g. 0x16, a TLS handshake sent to this plain port, gets its 400 at once instead of waiting
        # for a blank line that never comes: the client then says "does not answer TLS, use http://".
        if not (first.isalpha() or first in b"\r\n"):
            raise HttpError(400, "bad_request", "this port speaks plain HTTP and the request does not start with "
                                                "an HTTP method (TLS sent to a plain-HTTP port? use http://)")
        return first + await self.reader.readuntil(b"\r\n\r\n")

    async def _exchange(self, head: RequestHead) -> bool:
        """Receive the body, answer the request; whether the connection may serve another."""
        length, max_body = head.content_length, self.front.options.max_body
        # the application judges a head first when its body would be spooled, is over the limit or is awaited
        # (Expect: 100-continue): its own refusal (401, 413 in its own words) beats the front's 413
        asks = head.chunked or length > min(SPOOL_IN_MEMORY, max_body) or (head.expects_continue and length > 0)
        refusal, place, marks = await self._before_body(head, length <= max_body) if asks else (None, None, {})
        if refusal is not None:  # answered from the head: the body is never read
            await self._send(head, refusal, False)
            await self._linger()
            return False
        if length > max_body:
            raise HttpError(413, "payload_too_large", f"body of {length} bytes is over the limit of {max_body} bytes "
                            f"({self.front.options.max_body_flag})")
        if head.expects_continue and (length or head.chunked):
            await self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
        spool = self._spool_file(head, place)
        spool_dir = self.front.options.spool_dir
        # a spool's file is made where its first bytes are written (a body thread, or the spool's thread)
        body: IO[bytes] | None = None if spool else tempfile.SpooledTemporaryFile(
            SPOOL_IN_MEMORY, dir=None if spool_dir is None else str(spool_dir))
        try:
            size = await (self._receive_chunked(body, spool) if head.chunked else self._receive(body, length, spool))
            spooled = None if spool is None else await spool.finish(size)  # every write done before the rewind
            if spool is not None:
                body = spool.input()
            else:
                assert body is not None
                body.seek(0)
            environ = wsgi_environ(head, body, size, self.server, self.peer, self.front.scheme, FileBody) | marks
            if spooled is not None:
                environ[SPOOLED_BODY] = spooled
            answer = await self.front.call_app(environ)
        finally:
            if spool is not None:
                spool.discard()  # closes its file
            elif body is not None:
                body.close()
        assert self.front.stopping is not None  # set before the server accepts connections
        keep = head.keep_alive() and not self.front.stopping.is_set() and not any(
            k.lower() == "connection" and "close" in v.lower() for k, v in answer.headers)
        keep = keep and (answer.stream is None or head.version == "1.1")  # HTTP/1.0: a stream ends with the close
        await self._send(head, answer, keep)
        return keep

    def _spool_file(self, head: RequestHead, place: BodyPlace | None) -> Spool | None:
        """A named, hashed spool file for a large (or chunked) body when a spool_dir is set, or the place the
        application wants the body written to."""
        if self.front.options.spool_dir is None or not (head.chunked or head.content_length > SPOOL_IN_MEMORY):
            return None
        algorithm = requested_algorithm(head.header(DIGEST_HEADER.lower()))
        return Spool(self.front.options.spool_dir, algorithm, head.content_length, self.front.hashing, place)

    async def _before_body(self, head: RequestHead, may_place: bool) -> tuple[Answer | None, BodyPlace | None,
                                                                               dict[str, Any]]:
        """Ask the application (one trip to a request thread) whether it refuses this request from its head alone
        (``Admission``) and, if not, where the body goes (``BodyPlacer``, a spooled body of known length); with what
        the admission marked in the head's environ (keys under ``fedmoe.``), for the request's own environ."""
        admission, placer = self.front.options.admission, self.front.options.placer
        if placer is not None and not (may_place and not head.chunked and head.content_length > SPOOL_IN_MEMORY
                                       and self.front.options.spool_dir is not None
                                       and placer.wants(head.method, head.target.partition("?")[0])):
            placer = None
        if admission is None and placer is None:
            return None, None, {}
        environ = wsgi_environ(head, io.BytesIO(), head.content_length, self.server, self.peer, self.front.scheme,
                               FileBody)
        refusal, place = await asyncio.get_running_loop().run_in_executor(self.front.pool, _ask_before_body,
                                                                          admission, placer, environ)
        return refusal, place, {k: v for k, v in environ.items() if k.startswith(ADMISSION_MARKS)}

    async def _linger(self) -> None:
        """After an answer that left the body unread: stop sending, then read and drop what the client still sends
        for up to LINGER_SECONDS (or until it closes). Closing at once with its body in our receive buffer would
        reset the connection, and a reset can make the client's system drop our answer before the client reads
        it: a worker pushing with an expired token would see a broken connection, not its 401 (nginx lingers
        likewise, ``lingering_close``)."""
        if self.writer.can_write_eof():
            self.writer.write_eof()
        try:
            async with asyncio.timeout(min(self.timeout, LINGER_SECONDS)):
                while await self.reader.read(READ_CHUNK):
                    pass
        except (TimeoutError, ConnectionError, OSError, ssl.SSLError):
            pass

    @staticmethod
    async def _take(body: IO[bytes] | None, spool: Spool | None, chunk: bytes | memoryview) -> None:
        """Store a received chunk: through the spool's thread, or (small bodies) into ``body`` at once."""
        if spool is not None:
            await spool.feed(chunk)
        else:
            assert body is not None  # there is a body file whenever there is no spool
            write_chunk(body, chunk)

    async def _receive(self, body: IO[bytes] | None, length: int, spool: Spool | None = None) -> int:
        left = length  # what the direct read leaves (all when the buffers' budget is spent) goes through the stream
        if length >= DIRECT_FROM and hasattr(self.reader, "_buffer") and self.reader.exception() is None:
            left = await self._receive_direct(body, length, spool)
        while left:
            chunk = await self._read_body(min(READ_CHUNK, left))
            await self._take(body, spool, chunk)
            left -= len(chunk)
            del chunk  # not held while the next one is awaited (a stalled body's last piece, up to 384 KiB)
        return length

    async def _receive_direct(self, body: IO[bytes] | None, length: int, spool: Spool | None) -> int:
        """A large body read by a body thread (``read_on_thread``) when one is free, else (or for what a slow client
        sends after THREAD_STALL) by ``DirectBody`` straight into two buffers in turn, after the bytes that came in
        with the head; the stream protocol gets the transport back after it (or when it fails). Returns what is
        left for the stream to read (all of it, or what a body thread left, when the buffers' budget is spent)."""
        ahead = min(length, len(self.reader._buffer))  # type: ignore[attr-defined]  # CPython's StreamReader
        transport = cast(asyncio.Transport, self.writer.transport)
        if spool is not None and self._may_read_on_thread(transport, length - ahead):
            first = await self.reader.read(ahead) if ahead else b""  # at hand: returns at once
            left = length - ahead - await self._read_on_thread(transport, spool, first, length - ahead)
            if not left:
                self.front.bodies_read["thread"] += 1
                return 0
            length, ahead = left, 0  # a slow client: the loop reads the rest
        self.front.bodies_read["loop"] += 1
        buffers = self.front.buffers.take(DirectBody.buffers_for(length - ahead)) if length > ahead else None
        if buffers is None:
            return length
        stream = transport.get_protocol()
        direct = DirectBody(transport, stream, length - ahead, buffers)
        transport.set_protocol(direct)  # from now on the socket is read into direct's buffers only
        done = False
        try:
            if ahead:
                first = await self.reader.read(ahead)  # at hand: returns at once, with exactly these bytes
                await self._take(body, spool, first)
            if self.reader.at_eof():  # the client went away before the rest of the body
                raise asyncio.IncompleteReadError(b"", direct.left)
            transport.resume_reading()  # no-op unless the stream had paused it
            while direct.left:
                try:
                    chunk = await direct.next_chunk(self.timeout)
                except TimeoutError:
                    raise HttpError(408, "request_timeout", "the request body stopped arriving before its end; "
                                    "send it again") from None
                await self._take(body, spool, chunk)  # waits until the other buffer is written and hashed
                direct.resume()  # the other buffer is free: read into it
            if spool is not None:
                await spool.drain()
            done = True  # nothing uses the buffers any more: the next large body may
        finally:
            direct.release(self.front.buffers, reuse=done)  # else a thread may still write one out: dropped
            if not transport.is_closing():
                transport.set_protocol(stream)
                transport.resume_reading()
        return 0

    def _may_read_on_thread(self, transport: asyncio.Transport, left: int) -> bool:
        """Plain TCP (a Unix socket's MSG_WAITALL does not stop at the receive timeout), a free body thread, a body of a size the threads take, and nothing being written that the loop
        would send (the socket is blocking while a thread reads it)."""
        sock = transport.get_extra_info("socket")
        return (self.front.tls is None and self.front.free_body_threads > 0 and 0 < left <= THREAD_BODY_MAX
                and transport.get_write_buffer_size() == 0 and not self.reader.at_eof()
                and sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6))  # TCP's receive timeout

    async def _read_on_thread(self, transport: asyncio.Transport, spool: Spool, first: bytes, left: int) -> int:
        """Spool ``first`` and up to ``left`` more bytes on a body thread; the bytes it read from the socket."""
        front = self.front
        transport.pause_reading()  # the thread reads the socket from now on; nothing was read since ``first``
        buffers = front.buffers.take(1, bounded=False)
        assert buffers is not None  # unbounded: always
        buffer = buffers[0]
        front.free_body_threads -= 1
        job = front.bodies.submit(read_on_thread, transport.get_extra_info("socket").fileno(), spool, first, left,
                                  buffer, min(self.timeout, THREAD_STALL))
        try:
            return await asyncio.wrap_future(job)
        finally:
            front.free_body_threads += 1
            front.buffers.give_back(buffers, reuse=job.done())
            if not job.done():  # cancelled (shutdown) while the thread still reads: never read a blocking socket
                transport.abort()
            else:
                if not transport.is_closing():
                    transport.resume_reading()

    async def _receive_chunked(self, body: IO[bytes] | None, spool: Spool | None = None) -> int:
        size = 0
        while True:
            line = await self._chunk_line("chunk size line", 400, "bad_request")
            digits = line.split(b";", 1)[0].strip()
            if not CHUNK_SIZE.fullmatch(digits):  # int(..., 16) alone takes "-1", "+f", "0x1f", "1_0"
                raise HttpError(400, "bad_request", f"bad chunk size line {line[:40]!r}")
            chunk_size = int(digits, 16)
            if chunk_size == 0:
                while (await self._chunk_line("trailer", 431, "request_header_fields_too_large")) != b"\r\n":
                    pass  # trailers: ignored
                return size
            size += chunk_size
            if size > self.front.options.max_body:
                raise HttpError(413, "payload_too_large", f"body is larger than the limit of "
                                f"{self.front.options.max_body} bytes ({self.front.options.max_body_flag})")
            left = chunk_size
            while left:
                chunk = await self._read_body(min(READ_CHUNK, left))
                await self._take(body, spool, chunk)
                left -= len(chunk)
            if await self._with_timeout(self.reader.readexactly(2)) != b"\r\n":
                raise HttpError(400, "bad_request", "chunk not followed by CRLF")

    async def _chunk_line(self, what: str, status: int, code: str) -> bytes:
        """A chunked body's next CRLF-ended line (a chunk size or a trailer); ``status`` if it is over the head limit."""
        try:
            return await self._with_timeout(self.reader.readuntil(b"\r\n"))
        except asyncio.LimitOverrunError:
            raise HttpError(status, code, f"{what} over {HEAD_LIMIT} bytes") from None

    async def _read_body(self, n: int) -> bytes:
        try:
            async with asyncio.timeout(self.timeout):
                chunk = await self.reader.read(n)
        except asyncio.TimeoutError:
            raise HttpError(408, "request_timeout", "the request body stopped arriving before its end; "
                            "send it again") from None
        if not chunk:
            raise asyncio.IncompleteReadError(b"", n)
        return chunk

    async def _send(self, head: RequestHead, answer: Answer, keep: bool) -> None:
        if answer.stream is not None:
            await self._send_stream(head, answer, answer.stream, keep)
            return
        headers = answer.headers
        file, size = answer.file, sum(map(len, answer.chunks))
        names = {k.lower() for k, _ in headers}
        try:
            if file is not None:
                start = file.filelike.tell()
                size = os.fstat(file.filelike.fileno()).st_size - start
            if "content-length" not in names and "transfer-encoding" not in names:
                headers = [*headers, ("Content-Length", str(size))]
            await self._write(response_head(answer.status, headers, keep))
            if head.method == "HEAD":
                return
            if file is not None:
                await self._send_file(file.filelike, start, _declared_length(headers, size))
            for chunk in answer.chunks:
                await self._write(chunk)
        finally:
            if file is not None:
                file.close()

    async def _send_stream(self, head: RequestHead, answer: Answer, stream: StreamedBody, keep: bool) -> None:
        """An answer of unknown length, each chunk written (and drained) before the next is pulled: chunked transfer
        coding for HTTP/1.1, the connection's close marking its end for HTTP/1.0."""
        chunked = head.version == "1.1"
        headers = [(k, v) for k, v in answer.headers if k.lower() != "transfer-encoding"]
        pull: Future | None = None
        self.front.busy += 1  # the application still runs: shutdown's grace period waits for it
        try:
            await self._write(response_head(answer.status, headers + [("Transfer-Encoding", "chunked")] * chunked,
                                            keep))
            chunks: list[bytes | None] = list(answer.chunks)
            while True:
                for chunk in chunks:
                    if chunk is None:
                        if chunked:
                            await self._write(b"0\r\n\r\n")
                        return
                    await self._write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
                if self.reader.at_eof() or self.writer.is_closing():  # the client went away: stop the application
                    return
                pull = self.front.pool.submit(stream.next_chunk)
                chunks = [await asyncio.wrap_future(pull)]
        finally:
            self.front.busy -= 1
            # on a request thread, and never while a pull runs there (a generator cannot be closed while it runs):
            # a client gone mid-stream, or the connection cancelled at shutdown, ends it once the pull returns
            if pull is not None and not pull.done():
                pull.add_done_callback(lambda _: _close_quietly(stream))
            else:
                _submit_or_run(self.front.pool, _close_quietly, stream)

    async def _send_file(self, f: BinaryIO, offset: int, count: int) -> None:
        loop = asyncio.get_running_loop()
        end = offset + count
        await self._with_timeout(self.writer.drain())
        while offset < end:
            step = min(SENDFILE_CHUNK, end - offset)
            await self._with_timeout(loop.sendfile(self.writer.transport, f, offset, step))
            offset += step

    async def _write(self, data: bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), SEND_CHUNK):
            self.writer.write(view[start:start + SEND_CHUNK])
            await self._with_timeout(self.writer.drain())

    async def _with_timeout(self, awaitable: Any) -> Any:
        async with asyncio.timeout(self.timeout):
            return await awaitable

    async def _send_error(self, exc: HttpError) -> None:
        if exc.status >= 500 or exc.status == 408:
            log.warning("answered %d to %s: %s", exc.status, self.peer, exc.message)
        try:
            await self._write(error_response(exc.status, exc.code, exc.message, exc.details))
        except (asyncio.TimeoutError, ConnectionError, OSError, ssl.SSLError):
            pass


def _ask_before_body(admission: Admission | None, placer: BodyPlacer | None,
                     environ: dict[str, Any]) -> tuple[Answer | None, BodyPlace | None]:
    """On a request thread: the application's refusal from the head, or else where it wants the body (or None)."""
    if admission is not None:
        refusal = admission.admit(environ)  # a bug here is the request's 500, as in the application itself
        if refusal is not None:
            return refusal, None
    if placer is None:
        return None, None
    try:
        return None, placer.place(environ)
    except Exception:  # noqa: BLE001 - a bug in the placer: spool the body as usual, the application answers
        log.exception("could not place the body of %s %s (a bug); spooling it", environ.get("REQUEST_METHOD"),
                      environ.get("PATH_INFO"))
        return None, None


def small_reads(writer: asyncio.StreamWriter) -> None:
    """What a connection's stream reads at once (asyncio's default: 256 KiB) comes on top of its pause limit
    (2 x HEAD_LIMIT): a head's first body bytes, or a body read through the stream (past the receive buffers' budget,
    or chunked), then hold at most 192 KiB of memory, not 384 KiB (100 stalled bodies: 50 MiB, not 67)."""
    transport = getattr(writer, "transport", None)
    if hasattr(transport, "max_size"):  # a selector transport's (TLS reads in pieces of its own)
        transport.max_size = STREAM_READ  # type: ignore[union-attr]


def no_delay(sock: Any) -> None:
    """Send small writes at once (an answer's head and its body are separate writes). asyncio sets TCP_NODELAY only
    on sockets whose ``proto`` is IPPROTO_TCP, and a listening socket made with proto 0 (``socket.create_server``,
    the coordinator's) hands out accepted sockets with proto 0 too: with Nagle on, an answer's body waited for the
    client's delayed ACK, 40 ms per request (docs/scale.md, seventh round)."""
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # the connection is already gone: serving it fails on its own
            pass


def _close_quietly(stream: StreamedBody) -> None:
    try:
        stream.close()
    except Exception:  # noqa: BLE001 - the application's clean-up failed: its bug, logged; the connection is over
        log.exception("closing a streamed answer failed")


def _submit_or_run(pool: ThreadPoolExecutor, call: Callable[..., Any], *args: Any) -> None:
    """Run ``call`` on ``pool``, or here when the pool is shut down already (the server is stopping)."""
    try:
        pool.submit(call, *args)
    except RuntimeError:
        call(*args)


def _of_unknown_length(answer: Answer, environ: dict[str, Any]) -> bool:
    """Whether an answer from an iterator (not a list: its chunks are all there) is streamed: a body with no
    Content-Length (an application that knows its length, Flask for bytes, says it), not a HEAD request's and not
    a status that has no body."""
    status = answer.status.split(" ", 1)[0]
    return (environ.get("REQUEST_METHOD") != "HEAD" and status not in ("204", "304") and not status.startswith("1")
            and not any(k.lower() == "content-length" for k, _ in answer.headers))


def _has_fileno(f: BinaryIO) -> bool:
    try:
        f.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return False
    return True


def _declared_length(headers: list[tuple[str, str]], default: int) -> int:
    for k, v in headers:
        if k.lower() == "content-length" and v.isdigit():
            return int(v)
    return default
