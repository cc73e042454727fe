"""One client connection's bytes, for the buffering front: an asyncio protocol of its own, TLS done here.

Why not asyncio's streams (used until issue 31): to read a large body straight into its buffers, the front peeked at
the StreamReader's private ``_buffer``, swapped the transport's protocol in the middle of a request and shrank the
transport's private ``max_size``; and to keep 1,000 idle TLS connections from costing 300 MiB it patched
``asyncio.sslproto.SSLProtocol.max_size`` for the whole process (asyncio's TLS layer gives each connection a 256 KiB
read buffer, written full of zeros). A Python upgrade could break any of these. Here one ``BufferedProtocol`` owns the
connection from its first byte, with public asyncio and ssl APIs only:

- received bytes land where the request cycle wants them: in a large body's own buffer (``fill``: the socket is read
  straight into it, never past its end), or else among the ``pending`` bytes (heads, small and chunked bodies), read
  through one receive buffer that all connections share (each read is handed on before the next one starts);
- TLS (``TlsWire``, the same connection with a TLS layer between socket and request cycle) runs on an
  ``ssl.SSLObject`` over memory BIOs: ciphertext comes through the shared buffer and plaintext is decrypted straight
  into the body's buffer, so an idle TLS connection holds OpenSSL's session and nothing more;
- writes go out under the transport's flow control (``drain``).

The request cycle (coordinator/http/connection.py) applies the timeouts; this module only waits.
"""
from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any, cast

RECEIVE = 256 << 10  # the shared receive buffer: the most one socket read takes (ciphertext, or a head's bytes)
PENDING_READ = 64 << 10  # what one read adds to ``pending`` at most
PENDING_LIMIT = 128 << 10  # reading pauses while this much is pending: a stalled small body holds <= 192 KiB


class SharedBuffers:
    """The event loop's receive buffers, used by every connection in turn (one read at a time on one loop)."""

    def __init__(self) -> None:
        self.raw = memoryview(bytearray(RECEIVE))
        self.plain = memoryview(bytearray(PENDING_READ))  # TLS: plaintext on its way to ``pending``


class Wire(asyncio.BufferedProtocol):
    """A plain TCP connection's receiving and sending; ``on_open(wire)`` starts its request cycle once it is
    connected. ``TlsWire`` is the same over TLS."""

    tls: TlsSession | None = None
    """The TLS session (``TlsWire``); None on plain TCP."""

    def __init__(self, on_open: Callable[[Wire], None], shared: SharedBuffers) -> None:
        self.on_open, self.shared = on_open, shared
        self.transport: asyncio.Transport | None = None
        self.pending = bytearray()
        self.target: memoryview | None = None  # a body's buffer being filled straight from the socket
        self.filled = 0
        self.holding = False  # between two buffers of a large body: nothing is read into ``pending``
        self.lent = False  # a body thread reads the socket itself (coordinator/http/bodies.py, read_on_thread)
        self.eof = False
        self.lost: BaseException | None = None
        self.arrived_at = 0.0  # loop time of the last bytes received (progress, for stall timeouts)
        self._waiter: asyncio.Future | None = None
        self._write_paused = False
        self._drained: list[asyncio.Future] = []

    # the transport's side ---------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport: create_server's
        self.arrived_at = asyncio.get_running_loop().time()
        self.on_open(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.target is not None:
            return self.target[self.filled:]
        return self.shared.raw[:PENDING_READ]

    def buffer_updated(self, nbytes: int) -> None:
        self.arrived_at = asyncio.get_running_loop().time()
        if self.target is not None:
            self.filled += nbytes
            if self.filled == len(self.target):
                self._wake()
        else:
            self.pending += self.shared.raw[:nbytes]
            self._wake()
        self.sync_reading()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return True  # keep the transport open: the answer may still be written

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionResetError("the client closed the connection")
        self._wake()
        for waiter in self._drained:
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("the connection was lost while an answer was sent"))
        self._drained.clear()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        for waiter in self._drained:
            if not waiter.done():
                waiter.set_result(None)
        self._drained.clear()

    # the request cycle's side: receiving ----------------------------------------------------------------------

    async def wait(self) -> None:
        """Until something arrives (bytes, a full ``target``, the end, a loss); the caller applies the timeout and
        looks again (a wait may end with nothing new)."""
        before = len(self.pending), self.filled, self.eof
        self.sync_reading()  # TLS: plaintext OpenSSL holds since reading last paused comes first
        if (len(self.pending), self.filled, self.eof) != before:
            return
        if self.lost is not None and not self.pending:
            raise self.lost if isinstance(self.lost, (ConnectionError, ssl.SSLError)) else \
                ConnectionResetError(str(self.lost))
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def read_some(self, n: int) -> bytes:
        """Up to ``n`` pending bytes, waiting for some; b"" once the client has closed its side."""
        while not self.pending:
            if self.eof:
                return b""
            await self.wait()
        return self.take_pending(n)

    async def fill(self, view: memoryview, stall: float) -> None:
        """Fill ``view`` with the next bytes: pending ones first, then straight from the socket (TLS: decrypted into
        it). TimeoutError when nothing arrives for ``stall`` s, asyncio.IncompleteReadError at the client's end."""
        taken = min(len(self.pending), len(view))
        view[:taken] = self.pending[:taken]
        del self.pending[:taken]
        if taken == len(view):
            return
        loop = asyncio.get_running_loop()
        self.target, self.filled, self.arrived_at = view, taken, loop.time()
        try:
            self.sync_reading()
            while self.filled < len(view):
                if self.eof:
                    raise asyncio.IncompleteReadError(b"", len(view) - self.filled)
                try:
                    async with asyncio.timeout(max(0.0, self.arrived_at + stall - loop.time())):
                        await self.wait()
                except TimeoutError:
                    if loop.time() >= self.arrived_at + stall:  # no byte since: a stall, not a slow client
                        raise
        finally:
            self.target = None
            self.sync_reading()

    def unread(self, data: bytes) -> None:
        """Put back bytes read past a message's end (the next request's)."""
        self.pending[:0] = data
        self.sync_reading()

    def take_pending(self, n: int) -> bytes:
        """The first ``n`` pending bytes (fewer if fewer are pending), taken off."""
        chunk = bytes(self.pending[:n])
        del self.pending[:n]
        self.sync_reading()
        return chunk

    def hold(self, on: bool) -> None:
        """While a large body is read buffer by buffer: read nothing between two ``fill`` calls (the socket keeps the
        bytes until the next buffer is free, instead of ``pending`` copying them)."""
        self.holding = on
        self.sync_reading()

    def lend(self) -> Any:
        """The socket, for a body thread to read itself (plain TCP, nothing pending): reading stops until
        ``give_back``."""
        assert not self.pending and self.transport is not None
        self.lent = True
        self.sync_reading()
        return self.transport.get_extra_info("socket")

    def give_back(self) -> None:
        self.lent = False
        self.sync_reading()

    # sending ---------------------------------------------------------------------------------------------------

    def write(self, data: bytes | memoryview) -> None:
        assert self.transport is not None
        self.transport.write(data)

    async def drain(self) -> None:
        """Until the transport takes more (the caller applies the stall timeout)."""
        if self.lost is not None:
            raise ConnectionResetError("the connection was lost")
        if self._write_paused:
            waiter = asyncio.get_running_loop().create_future()
            self._drained.append(waiter)
            await waiter

    def write_eof(self) -> None:
        """No more bytes from us: a FIN (TLS: close_notify, the connection's end)."""
        assert self.transport is not None
        if self.transport.can_write_eof():
            self.transport.write_eof()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    @property
    def closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    # internals --------------------------------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _wants_bytes(self) -> bool:
        if self.lent or self.lost is not None:
            return False
        if self.target is not None:
            return self.filled < len(self.target)
        return not self.holding and len(self.pending) < PENDING_LIMIT

    def _wants_socket(self) -> bool:
        """Whether to read the socket: while the request cycle has room (TLS: also during the handshake)."""
        return self._wants_bytes()

    def sync_reading(self) -> None:
        """Read from the socket exactly while the request cycle has room for bytes (public transport calls only)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self.eof:  # nothing more will come (toggling would only report the end again)
            return
        if self._wants_socket():
            if not transport.is_reading():
                transport.resume_reading()
        elif transport.is_reading():
            transport.pause_reading()


class TlsWire(Wire):
    """A TLS connection: ciphertext arrives through the shared buffer, is decrypted into the body's buffer or
    ``pending``, and every write is encrypted on its way out."""

    tls: TlsSession

    def __init__(self, on_open: Callable[[Wire], None], shared: SharedBuffers, context: ssl.SSLContext) -> None:
        super().__init__(on_open, shared)
        self.tls = TlsSession(context)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.shared.raw  # ciphertext: never straight into a body's buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.arrived_at = asyncio.get_running_loop().time()
        self.tls.incoming.write(self.shared.raw[:nbytes])
        self._tls_progress()
        self.sync_reading()

    def eof_received(self) -> bool:
        self.tls.incoming.write_eof()
        self._tls_progress()
        return super().eof_received()

    async def read_some(self, n: int) -> bytes:
        while not self.pending:
            if self.eof and not self._decrypt_now():
                return b""
            await self.wait()
        return self.take_pending(n)

    def lend(self) -> Any:
        raise AssertionError("a TLS connection's socket carries ciphertext: bodies are read through the wire")

    def write(self, data: bytes | memoryview) -> None:
        assert self.transport is not None
        self.tls.obj.write(data)
        self._flush_tls()

    def write_eof(self) -> None:
        assert self.transport is not None
        self.tls.close_notify()
        self._flush_tls()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing() and self.tls.handshaken:
            self.tls.close_notify()
            self._flush_tls()
        super().close()

    def _wants_socket(self) -> bool:
        return self._wants_bytes() or not self.tls.handshaken

    def sync_reading(self) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing() and self._wants_bytes() and self.tls.handshaken:
            self._decrypt()  # plaintext OpenSSL already holds comes first
        super().sync_reading()

    def _tls_progress(self) -> None:
        try:
            if self.tls.handshaken or self.tls.handshake():
                self._decrypt()
        except (ssl.SSLError, OSError) as exc:  # plain HTTP to a TLS port, a failed handshake
            self._fail(exc)
        finally:
            self._flush_tls()

    def _decrypt_now(self) -> bool:
        """Whether plaintext OpenSSL still held reached ``pending`` (after the client's end, before saying so)."""
        before = len(self.pending)
        self._decrypt()
        return len(self.pending) > before

    def _decrypt(self) -> None:
        """Decrypt into the target, else into ``pending``, while there is room and plaintext."""
        try:
            while self._wants_bytes():
                view = self.target[self.filled:] if self.target is not None else self.shared.plain
                n = self.tls.read_into(view)
                if n is None:
                    break
                if n == 0:  # close_notify: the client's end
                    self.eof = True
                    self._wake()
                    break
                if self.target is None:
                    self.pending += view[:n]
                    self._wake()
                else:
                    self.filled += n
                    if self.filled == len(self.target):
                        self._wake()
        except (ssl.SSLError, OSError) as exc:  # a bad record, or the connection's end without close_notify
            self._fail(exc)
        self._flush_tls()  # what reading produced to send: post-handshake messages, key updates

    def _fail(self, exc: BaseException) -> None:
        self.lost = exc
        self._wake()
        if self.transport is not None:
            self.transport.abort()

    def _flush_tls(self) -> None:
        data = self.tls.outgoing.read()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


class TlsSession:
    """A server-side TLS session over memory BIOs (``ssl.SSLContext.wrap_bio``)."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.handshaken = False

    def handshake(self) -> bool:
        """One step of the handshake; whether it is done (SSLError if it failed)."""
        try:
            self.obj.do_handshake()
        except ssl.SSLWantReadError:
            return False
        self.handshaken = True
        return True

    def read_into(self, view: memoryview) -> int | None:
        """Decrypt into ``view``: the bytes written, 0 at the client's close_notify, None when more ciphertext is
        needed first."""
        try:  # with a buffer, read() returns the bytes it wrote (typeshed knows only the bytes form)
            return cast(int, self.obj.read(len(view), view))
        except ssl.SSLWantReadError:
            return None
        except ssl.SSLZeroReturnError:
            return 0

    def close_notify(self) -> None:
        try:
            self.obj.unwrap()
        except (ssl.SSLWantReadError, ssl.SSLError):  # the client's close_notify is not awaited
            pass
