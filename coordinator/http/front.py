"""The coordinator's HTTP server: an asyncio front that buffers whole requests before a thread runs the application.

Why not gunicorn's threaded worker (used until issue 13): its request threads read request heads and bodies
themselves, so 16 clients dripping one header line every few seconds (plain or TLS) held all 16 threads and every
other client waited (issue 13, defect 2). Here one event loop owns every connection: TLS handshakes, heads, bodies
(spooled to a file in the data dir past 1 MiB, never RAM) and the writing of answers all happen in the loop, and a
request thread runs the application only once its request is complete, and returns as soon as the answer is built.
Files (weight pulls) are sent by the loop with sendfile; a slow reader costs a socket, not a thread. Measured
(bench/hostile.py, docs/benchmarks.md): 1,000 slow connections, /health p99 well under 1 s.

The parts (coordinator/http/): each connection's bytes and TLS (wire.py: an asyncio protocol of its own, public
asyncio and ssl APIs only), its request cycle (connection.py: heads parsed by h11 in coordinator/http/heads.py, bodies
received as coordinator/http/bodies.py says), the application's side of WSGI (wsgi.py) and the settings
(options.py), and what all connections share (shared.py: the thread pools, buffers and counters). This module holds
them together: the listening socket and shutdown.

A body over 1 MiB is written as it arrives to a named file in ``spool_dir`` (the blob store's temp dir) and hashed on
the way (the algorithm the client's X-FedMoE-Digest names, BLAKE3 by default) on a hashing thread that overlaps the
next read. The application finds it as ``environ[SPOOLED_BODY]`` and may take the file over (rename it into the
store) instead of copying the body again: the copy and the second hashing pass were a third of a 1 GiB push (issue
18, docs/scale.md). An application that knows where a body belongs before it arrives (``FrontOptions.placer``: a
resumable upload's chunk goes into its upload's file) gets it written there instead of a spool file, and copies
nothing.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import signal
import socket
import ssl

from coordinator.http.connection import Connection, no_delay
from coordinator.http.options import FrontOptions
from coordinator.http.shared import FrontShared
from coordinator.http.wire import SharedBuffers, TlsWire, Wire
from coordinator.http.wsgi import WsgiApp

log = logging.getLogger(__name__)
GRACE_SECONDS = 10.0  # on SIGTERM, how long requests being answered get to finish


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
        self.sock, self.options, self.tls = sock, options, tls
        self.shared = FrontShared(app, options, "https" if tls else "http")
        self.loop_buffers = SharedBuffers()  # the loop's receive buffers, one read at a time
        self.connections: set[asyncio.Task] = set()

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        stopping = self.shared.stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        self.sock.setblocking(False)
        server = await loop.create_server(self._wire, sock=self.sock)
        await stopping.wait()
        server.close()  # stop accepting; requests being answered get GRACE_SECONDS
        deadline = loop.time() + GRACE_SECONDS
        while self.shared.busy and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for task in list(self.connections):
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
        self.shared.shutdown()
        log.info("front: %d large bodies read on body threads, %d by the event loop (at least in part)",
                 self.shared.bodies_read["thread"], self.shared.bodies_read["loop"])

    def _wire(self) -> Wire:
        """A new connection's protocol (TLS when the front has a certificate)."""
        if self.tls is None:
            return Wire(self.open, self.loop_buffers)
        return TlsWire(self.open, self.loop_buffers, self.tls)

    def open(self, wire: Wire) -> None:
        """A connection was accepted (its ``Wire`` is connected): start its request cycle, or close it when the front
        holds --max-connections already."""
        assert wire.transport is not None  # connection_made's
        if len(self.connections) >= self.options.max_connections:
            wire.transport.abort()
            return
        no_delay(wire.transport.get_extra_info("socket"))
        task = asyncio.get_running_loop().create_task(self._serve(wire))
        self.connections.add(task)
        task.add_done_callback(self.connections.discard)

    async def _serve(self, wire: Wire) -> None:
        try:
            await Connection(self.shared, wire).serve()
        except asyncio.CancelledError:
            pass
        finally:
            wire.close()
