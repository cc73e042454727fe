"""Slow and idle clients for bench/hostile.py: many connections that each hold a socket open cheaply.

Kinds (one asyncio task per connection, all in one background thread):

- ``drip_headers``: a request line, then one header line every ``interval`` seconds, never the end.
- ``slow_body``: a whole head announcing a 5 MB body, then one byte every ``interval`` seconds.
- ``idle_keepalive``: one complete GET /health, its answer read, then nothing (connection kept).
- ``slow_reader``: a GET of an expert's weights whose answer is never read.

No token is needed for the first three (the server must not need to read a token to stay
available); the slow reader uses one, since weights are not public. Kinds on the newer routes
(bench/hostile_surface.py), each with the token:

- ``slow_probe``: ``POST /api/v1/probe`` announcing 4 MiB (the probe's limit), one byte every ``interval``.
- ``stalled_probe``: the same, but 2.5 MiB at once first, then one byte every ``interval``: a body that
  filled the front's receive buffers and then stalls.
- ``slow_chunk``: ``PUT`` of a resumable upload's chunk (``chunk_path``) announcing 1 MiB, one byte
  every ``interval``.
"""
from __future__ import annotations

import asyncio
import ssl
import threading
from dataclasses import dataclass, field

KINDS = ("drip_headers", "slow_body", "idle_keepalive", "slow_reader")
SURFACE_KINDS = ("slow_probe", "stalled_probe", "slow_chunk")
PROBE_BODY = 4 << 20  # protocol.probe.MAX_PROBE_BYTES


@dataclass
class Attack:
    host: str
    port: int
    tls: bool
    counts: dict[str, int]
    """Connections of each kind."""
    weights_path: str
    token: str
    interval: float = 2.0
    chunk_path: str = "/api/v1/experts/e/uploads/none"
    """Where ``slow_chunk`` PUTs (an open upload's URL path)."""
    health_path: str = "/api/v1/health"
    """What ``drip_headers`` and ``idle_keepalive`` GET (a route that needs no token)."""
    body_path: str = "/api/v1/experts/e/updates"
    """Where ``slow_body`` POSTs, announcing ``body_size`` bytes."""
    body_size: int = 5_000_000
    opened: dict[str, int] = field(default_factory=dict)
    closed_by_server: dict[str, int] = field(default_factory=dict)
    failed_to_open: int = 0

    def __post_init__(self) -> None:
        self.opened = self.opened or dict.fromkeys(self.counts, 0)
        self.closed_by_server = self.closed_by_server or dict.fromkeys(self.counts, 0)
        self._loop = asyncio.new_event_loop()
        # An asyncio.Event binds to a loop only when first awaited (Python >= 3.10): made here, it is never None,
        # so stop() before the thread has reached _main still finds it.
        self._stop = asyncio.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slow-clients", daemon=True)

    def start(self, timeout: float = 90.0) -> bool:
        """Open the connections (64 connecting at once); whether all are open or failed within ``timeout``.

        A server that serves no one while slow clients hold it does not finish opening them (the idle
        kind waits for an answer): the attack then goes on with those open so far.
        """
        self._thread.start()
        return self._ready.wait(timeout)

    @property
    def open_now(self) -> int:
        return sum(self.opened.values()) - sum(self.closed_by_server.values())

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)

    def _run(self) -> None:
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        context = None
        if self.tls:
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        gate = asyncio.Semaphore(64)
        opened: list[asyncio.Event] = []
        tasks = []
        for kind in (*KINDS, *SURFACE_KINDS):
            for _ in range(self.counts.get(kind, 0)):
                ready = asyncio.Event()
                opened.append(ready)
                tasks.append(asyncio.create_task(self._client(kind, context, gate, ready)))
        for ready in opened:
            await ready.wait()
        self._ready.set()
        await self._stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _client(self, kind: str, context: ssl.SSLContext | None, gate: asyncio.Semaphore,
                      ready: asyncio.Event) -> None:
        writer = None
        try:
            async with gate:
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(self.host, self.port, ssl=context), 60)
                    await getattr(self, "_open_" + kind)(reader, writer)
                except (OSError, asyncio.TimeoutError, ssl.SSLError):
                    self.failed_to_open += 1
                    return
            self.opened[kind] += 1
            ready.set()
            if await self._hold(kind, reader, writer):
                self.closed_by_server[kind] += 1
        finally:
            ready.set()
            if writer is not None:
                writer.close()

    async def _open_drip_headers(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(f"GET {self.health_path} HTTP/1.1\r\nHost: bench\r\n".encode())
        await writer.drain()

    async def _open_slow_body(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(f"POST {self.body_path} HTTP/1.1\r\nHost: bench\r\nContent-Length: {self.body_size}\r\n\r\nx"
                     .encode())
        await writer.drain()

    async def _open_idle_keepalive(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(f"GET {self.health_path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)

    async def _open_slow_reader(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(f"GET {self.weights_path} HTTP/1.1\r\nHost: bench\r\n"
                     f"Authorization: Bearer {self.token}\r\n\r\n".encode())
        await writer.drain()

    async def _open_slow_probe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                               first: bytes = b"x") -> None:
        writer.write(f"POST /api/v1/probe HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {self.token}\r\n"
                     f"Content-Length: {PROBE_BODY}\r\n\r\n".encode() + first)
        await writer.drain()

    async def _open_stalled_probe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._open_slow_probe(reader, writer, b"\1" * (5 << 19))

    async def _open_slow_chunk(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(f"PUT {self.chunk_path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {self.token}\r\n"
                     f"Content-Range: bytes 0-{(1 << 20) - 1}/*\r\nContent-Length: {1 << 20}\r\n\r\nx".encode())
        await writer.drain()

    async def _hold(self, kind: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Keep the connection as its kind does until stopped; True if the server closed it first."""
        step = {"drip_headers": b"X-Drip: 1\r\n"}.get(kind, b"x" if kind not in ("idle_keepalive", "slow_reader") else None)
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval)
                return False
            except asyncio.TimeoutError:
                pass
            if kind == "idle_keepalive" and reader.at_eof():
                return True
            if step is not None:
                try:
                    writer.write(step)
                    await writer.drain()
                except (OSError, ssl.SSLError):
                    return True
            if writer.is_closing() or (kind != "slow_reader" and reader.at_eof()):
                return True
        return False
