"""One client connection's request cycle in the buffering front: read a whole request, let a thread answer it, write
the answer; repeat (coordinator/http/front.py runs one per connection, on the event loop).

Heads are parsed by h11 (coordinator/http/heads.py); bodies are received by coordinator/http/receiving.py: a small
one into memory, a large one (over SPOOL_IN_MEMORY) spooled to a named file as it arrives and hashed on the way
(coordinator/http/bodies.py). Before a body is read, the
application may judge the head alone (``Admission``: 401, 413, 429 without reading the body) and say where the body
goes (``BodyPlacer``). --socket-timeout keeps its meaning: a connection whose head, body or answer makes no progress
for that long is dropped (a stalled body is answered 408 first).
"""
from __future__ import annotations

import asyncio
import io
import logging
import os
import socket
import ssl
import tempfile
from typing import IO, Any, BinaryIO

from coordinator.http.bodies import Spool
from coordinator.storage.incoming import BodyPlace
from coordinator.http.options import ask_before_body
from coordinator.http.receiving import READ_CHUNK, BodyReceiver
from coordinator.http.shared import FrontShared
from coordinator.http.wire import Wire
from coordinator.http.wsgi import ADMISSION_MARKS, SPOOLED_BODY, Answer, FileBody, StreamedBody, close_quietly, \
    close_stream, declared_length
from coordinator.http.heads import HEAD_LIMIT, HttpError, RequestHead, error_response, parse_head, response_head, \
    wsgi_environ
from protocol.integrity import DIGEST_HEADER, requested_algorithm

log = logging.getLogger(__name__)
SPOOL_IN_MEMORY = 1 << 20  # request bodies up to this stay in memory; larger ones go to disk
SEND_CHUNK = 1 << 20  # one stall-timeout step of an answer: a client slower than this per timeout is dropped
SENDFILE_CHUNK = 4 << 20  # the same for files: fewer steps, so pulls run near gunicorn's sendfile rate
TLS_FILE_CHUNK = 256 << 10  # a file over TLS is read, encrypted and written this much at a time (asyncio's sendfile
# fallback reads as much): a slow reader's answer holds this plus the transport's 64 KiB, not a whole SEND_CHUNK
LINGER_SECONDS = 5.0  # how long an answer sent before its request's body is followed by reading and dropping that body
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Connection:
    """One client connection: read a whole request, let a thread answer it, write the answer; repeat."""

    def __init__(self, front: FrontShared, wire: Wire) -> None:
        self.front, self.wire = front, wire
        self.timeout = front.options.socket_timeout
        self.bodies = BodyReceiver(front, wire, self.timeout)
        assert wire.transport is not None  # connected
        self.peer = wire.transport.get_extra_info("peername")
        self.server = wire.transport.get_extra_info("sockname")

    async def serve(self) -> None:
        first = True
        assert self.front.stopping is not None  # set before the server accepts connections
        try:
            await self._handshake()
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

    async def _handshake(self) -> None:
        """TLS: the handshake, within --socket-timeout (asyncio's ssl_handshake_timeout before)."""
        tls = self.wire.tls
        if tls is not None:
            async with asyncio.timeout(self.timeout):
                while not tls.handshaken:
                    await self.wire.wait()

    # heads -----------------------------------------------------------------------------------------------------

    async def _read_head(self, timeout: float) -> RequestHead | None:
        """The next request head, None at a clean end; the whole head must arrive within ``timeout``."""
        async with asyncio.timeout(timeout):  # no task per call, unlike wait_for (3.11)
            raw = await self._raw_head()
        return None if raw is None else parse_head(raw)

    async def _raw_head(self) -> bytes | None:
        wire, searched = self.wire, 0
        while True:
            while wire.pending[:2] == b"\r\n":  # empty lines before a request are ignored (RFC 9112 section 2.2)
                wire.take_pending(2)
                searched = 0
            # A request starts with a method (letters). Anything else, e.g. 0x16, a TLS handshake sent to this plain
            # port, gets its 400 at once instead of waiting for a blank line that never comes: the client then
            # says "does not answer TLS, use http://".
            if wire.pending[:1] and not (wire.pending[:1].isalpha() or wire.pending[:1] == b"\r"):
                raise HttpError(400, "bad_request", "this port speaks plain HTTP and the request does not start with "
                                                    "an HTTP method (TLS sent to a plain-HTTP port? use http://)")
            end = wire.pending.find(b"\r\n\r\n", max(0, searched - 3))
            if end >= 0:
                return wire.take_pending(end + 4)
            if len(wire.pending) > HEAD_LIMIT:
                raise HttpError(431, "request_header_fields_too_large",
                                f"request line and headers are over {HEAD_LIMIT} bytes")
            searched = len(wire.pending)
            if wire.eof:
                if wire.pending.strip():
                    raise asyncio.IncompleteReadError(bytes(wire.pending), None)
                return None
            await wire.wait()

    # one request -----------------------------------------------------------------------------------------------

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
            await self._write(CONTINUE)
        answer = await self._receive_and_answer(head, length, place, marks)
        assert self.front.stopping is not None  # set before the server accepts connections
        keep = head.keep_alive() and not self.front.stopping.is_set() and not any(
            k.lower() == "connection" and "close" in v.lower() for k, v in answer.headers)
        keep = keep and (answer.stream is None or head.version == "1.1")  # HTTP/1.0: a stream ends with the close
        await self._send(head, answer, keep)
        return keep

    async def _receive_and_answer(self, head: RequestHead, length: int, place: BodyPlace | None,
                                  marks: dict[str, Any]) -> Answer:
        spool = self._spool_file(head, place)
        spool_dir = self.front.options.spool_dir
        # a spool's file is made where its first bytes are written (a body thread, or the spool's thread)
        body: IO[bytes] | None = None if spool else tempfile.SpooledTemporaryFile(
            SPOOL_IN_MEMORY, dir=None if spool_dir is None else str(spool_dir))
        try:
            size = await self.bodies.receive(head, body, spool)
            spooled = None if spool is None else await spool.finish(size)  # every write done before the rewind
            if spool is not None:
                body = spool.input()
            else:
                assert body is not None
                body.seek(0)
            environ = wsgi_environ(head, body, size, self.server, self.peer, self.front.scheme, FileBody) | marks
            if spooled is not None:
                environ[SPOOLED_BODY] = spooled
            return await self.front.call_app(environ)
        finally:
            if spool is not None:
                spool.discard()  # closes its file
            elif body is not None:
                body.close()

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
        refusal, place = await asyncio.get_running_loop().run_in_executor(self.front.pool, ask_before_body,
                                                                          admission, placer, environ)
        return refusal, place, {k: v for k, v in environ.items() if k.startswith(ADMISSION_MARKS)}

    async def _linger(self) -> None:
        """After an answer that left the body unread: stop sending, then read and drop what the client still sends
        for up to LINGER_SECONDS (or until it closes). Closing at once with its body in our receive buffer would
        reset the connection, and a reset can make the client's system drop our answer before the client reads
        it: a worker pushing with an expired token would see a broken connection, not its 401 (nginx lingers
        likewise, ``lingering_close``)."""
        self.wire.write_eof()
        try:
            async with asyncio.timeout(min(self.timeout, LINGER_SECONDS)):
                while await self.wire.read_some(READ_CHUNK):
                    pass
        except (TimeoutError, ConnectionError, OSError, ssl.SSLError):
            pass

    # answers ---------------------------------------------------------------------------------------------------

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
                await self._send_file(file.filelike, start, declared_length(headers, size))
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
        pull = None
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
                if self.wire.eof or self.wire.closing:  # the client went away: stop the application
                    return
                pull = self.front.pool.submit(stream.next_chunk)
                chunks = [await asyncio.wrap_future(pull)]
        finally:
            self.front.busy -= 1
            # on a request thread, and never while a pull runs there (a generator cannot be closed while it runs):
            # a client gone mid-stream, or the connection cancelled at shutdown, ends it once the pull returns
            if pull is not None and not pull.done():
                pull.add_done_callback(lambda _: close_quietly(stream))
            else:
                close_stream(stream, self.front.pool)

    async def _send_file(self, f: BinaryIO, offset: int, count: int) -> None:
        """Plain TCP: the kernel's sendfile, in steps; TLS: read on a thread, encrypted and written in steps."""
        loop = asyncio.get_running_loop()
        end = offset + count
        await self._with_timeout(self.wire.drain())
        while offset < end:
            if self.wire.tls is None:
                step = min(SENDFILE_CHUNK, end - offset)
                assert self.wire.transport is not None
                try:
                    await self._with_timeout(loop.sendfile(self.wire.transport, f, offset, step))
                finally:
                    self.wire.sync_reading()  # sendfile paused and resumed reading on its own
            else:
                data = await loop.run_in_executor(None, os.pread, f.fileno(), min(TLS_FILE_CHUNK, end - offset),
                                                  offset)
                if not data:
                    raise OSError(f"the file ended {end - offset} bytes before its declared length")
                await self._write(data)
                step = len(data)
            offset += step

    async def _write(self, data: bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), SEND_CHUNK):
            self.wire.write(view[start:start + SEND_CHUNK])
            await self._with_timeout(self.wire.drain())

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
