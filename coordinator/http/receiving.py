"""A request body on its way in, for the request cycle (coordinator/http/connection.py).

A small body is read through the connection's pending bytes; a large one (DIRECT_FROM and up) straight into two
receive buffers of the front's ``BufferBudget`` in turn (``Wire.fill``), or by a body thread with blocking receives
(``read_on_thread``, coordinator/http/bodies.py) when one is free; a chunked body's framing is read by the h11
connection that parsed its head. Each piece goes to memory, to a spool file (hashed on the way) or to the place the
application asked for. A body that makes no progress for --socket-timeout is a 408.
"""
from __future__ import annotations

import asyncio
import socket
from typing import IO

import h11

from coordinator.http.bodies import DIRECT_CHUNK, Spool, read_on_thread, write_chunk
from coordinator.http.heads import HttpError, RequestHead
from coordinator.http.shared import FrontShared
from coordinator.http.wire import Wire

READ_CHUNK = 1 << 20
DIRECT_FROM = 256 << 10  # bodies from this size on are read straight into buffers (Wire.fill)
THREAD_BODY_MAX = 16 << 20  # larger bodies stay on the loop, whose receive, write and hash of a body overlap
THREAD_STALL = 2.0  # seconds a body thread waits for a piece before the loop takes the connection back


class BodyReceiver:
    """One connection's request bodies, each into ``body`` (a file in memory or on disk) or through a ``Spool``."""

    def __init__(self, front: FrontShared, wire: Wire, timeout: float) -> None:
        self.front, self.wire, self.timeout = front, wire, timeout

    async def receive(self, head: RequestHead, body: IO[bytes] | None, spool: Spool | None) -> int:
        """The whole body of ``head``'s request; its size."""
        if head.chunked:
            return await self._receive_chunked(head, body, spool)
        return await self._receive(body, head.content_length, spool)

    # bodies ----------------------------------------------------------------------------------------------------

    @staticmethod
    async def _take(body: IO[bytes] | None, spool: Spool | None, chunk: bytes | memoryview) -> None:
        """Store a received chunk: through the spool's thread, or (small bodies) into ``body`` at once."""
        if spool is not None:
            await spool.feed(chunk)
        else:
            assert body is not None  # there is a body file whenever there is no spool
            write_chunk(body, chunk)

    async def _receive(self, body: IO[bytes] | None, length: int, spool: Spool | None = None) -> int:
        left = length  # what the direct read leaves (all when the buffers' budget is spent) goes through ``pending``
        if length >= DIRECT_FROM:
            left = await self._receive_direct(body, length, spool)
        while left:
            chunk = await self._read_body(min(READ_CHUNK, left))
            await self._take(body, spool, chunk)
            left -= len(chunk)
            del chunk  # not held while the next one is awaited
        return length

    async def _receive_direct(self, body: IO[bytes] | None, length: int, spool: Spool | None) -> int:
        """A large body read by a body thread (``read_on_thread``) when one is free, else (or for what a slow client
        sends after THREAD_STALL) by the loop straight into two buffers in turn, the bytes that came with the head
        first. Returns what is left to read through ``pending`` (all of it when the buffers' budget is spent)."""
        ahead = min(length, len(self.wire.pending))
        if spool is not None and self._may_read_on_thread(length - ahead):
            first = self.wire.take_pending(ahead)
            left = length - ahead - await self._read_on_thread(spool, first, length - ahead)
            if not left:
                self.front.bodies_read["thread"] += 1
                return 0
            length = left  # a slow client: the loop reads the rest
        self.front.bodies_read["loop"] += 1
        buffers = self.front.buffers.take(2 if length > DIRECT_CHUNK else 1)
        if buffers is None:
            return length
        views = [memoryview(b) for b in buffers]
        done = False
        self.wire.hold(True)  # between two buffers the socket keeps the bytes
        try:
            left, turn = length, 0
            while left:
                view = views[turn][:min(left, len(views[turn]))]
                try:
                    await self.wire.fill(view, self.timeout)
                except TimeoutError:
                    raise HttpError(408, "request_timeout", "the request body stopped arriving before its end; "
                                    "send it again") from None
                await self._take(body, spool, view)  # waits until the other buffer is written and hashed
                left -= len(view)
                turn = (turn + 1) % len(views)
            if spool is not None:
                await spool.drain()
            done = True  # nothing uses the buffers any more: the next large body may
        finally:
            self.wire.hold(False)
            self.front.buffers.give_back(buffers, reuse=done)  # else a thread may still write one out: dropped
        return 0

    def _may_read_on_thread(self, left: int) -> bool:
        """Plain TCP (a Unix socket's MSG_WAITALL does not stop at the receive timeout), a free body thread, a body of
        a size the threads take, and nothing being written that the loop would send (the socket is blocking while a
        thread reads it)."""
        transport = self.wire.transport
        sock = None if transport is None else transport.get_extra_info("socket")
        return (self.wire.tls is None and self.front.free_body_threads > 0 and 0 < left <= THREAD_BODY_MAX
                and transport is not None and transport.get_write_buffer_size() == 0 and not self.wire.eof
                and sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6))  # TCP's receive timeout

    async def _read_on_thread(self, spool: Spool, first: bytes, left: int) -> int:
        """Spool ``first`` and up to ``left`` more bytes on a body thread; the bytes it read from the socket."""
        front = self.front
        sock = self.wire.lend()  # the thread reads the socket from now on; nothing was read since ``first``
        buffers = front.buffers.take(1, bounded=False)
        assert buffers is not None  # unbounded: always
        front.free_body_threads -= 1
        job = front.bodies.submit(read_on_thread, sock.fileno(), spool, first, left, buffers[0],
                                  min(self.timeout, THREAD_STALL))
        try:
            return await asyncio.wrap_future(job)
        finally:
            front.free_body_threads += 1
            front.buffers.give_back(buffers, reuse=job.done())
            if not job.done() and self.wire.transport is not None:  # cancelled (shutdown) while the thread reads:
                self.wire.transport.abort()  # never leave it a socket the loop uses
            else:
                self.wire.give_back()

    async def _receive_chunked(self, head: RequestHead, body: IO[bytes] | None, spool: Spool | None = None) -> int:
        """A chunked body, its framing read by the h11 connection that parsed its head; the bytes after its end
        (the next request's) go back to ``pending``."""
        parser, size = head.parser, 0
        assert parser is not None  # parse_head's
        while True:
            try:
                event = parser.next_event()
            except h11.RemoteProtocolError as exc:  # a bad size line, no CRLF after a chunk, an overlong line
                raise HttpError(400, "bad_request", f"malformed chunked body: {exc}") from None
            if event is h11.NEED_DATA:
                parser.receive_data(await self._read_body(READ_CHUNK))
            elif isinstance(event, h11.Data):
                size += len(event.data)
                if size > self.front.options.max_body:
                    raise HttpError(413, "payload_too_large", f"body is larger than the limit of "
                                    f"{self.front.options.max_body} bytes ({self.front.options.max_body_flag})")
                await self._take(body, spool, event.data)
            elif isinstance(event, h11.EndOfMessage):
                self.wire.unread(parser.trailing_data[0])
                return size

    async def _read_body(self, n: int) -> bytes:
        try:
            async with asyncio.timeout(self.timeout):
                chunk = await self.wire.read_some(n)
        except TimeoutError:
            raise HttpError(408, "request_timeout", "the request body stopped arriving before its end; "
                            "send it again") from None
        if not chunk:
            raise asyncio.IncompleteReadError(b"", n)
        return chunk
