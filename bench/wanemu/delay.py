"""A userspace TCP proxy that adds a one-way delay to every chunk, in both directions.

The kernel here has no ``netem``, so latency lives in this proxy: each chunk read from one side
is stamped and written to the other side ``one_way_s`` later. Chunks of one direction are
pipelined (a reader thread and a writer thread per direction), so the delay does not cap the
throughput: bandwidth is still set by the ``tbf`` shaping of the link the bytes cross. A bounded
buffer per direction (``buffer_bytes``) keeps TCP backpressure: a slow receiver stalls the sender
instead of the proxy swallowing a whole body. Connection setup itself is not delayed.
"""
from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

CHUNK = 64 * 1024


@dataclass
class _Pipe:
    """One direction of one connection: a bounded FIFO of (due time, bytes)."""

    limit: int
    items: collections.deque = field(default_factory=collections.deque)
    size: int = 0
    closed: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition)

    def put(self, due: float, data: bytes) -> None:
        with self.cond:
            while self.size >= self.limit and not self.closed:
                self.cond.wait(0.5)
            self.items.append((due, data))
            self.size += len(data)
            self.cond.notify_all()

    def get(self) -> tuple[float, bytes] | None:
        with self.cond:
            while not self.items and not self.closed:
                self.cond.wait(0.5)
            if not self.items:
                return None
            due, data = self.items.popleft()
            self.size -= len(data)
            self.cond.notify_all()
            return due, data

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class DelayProxy:
    """Listen on ``listen`` and forward each connection to ``target``, delaying both directions.

    ``cut_after``: when set, the proxy closes each connection after forwarding that many bytes
    towards the client (target -> client, counted per connection); used to interrupt a download
    mid-body. ``bytes_to_client``/``bytes_to_target`` count all connections.
    """

    def __init__(self, target: tuple[str, int], one_way_s: float, listen: tuple[str, int] = ("127.0.0.1", 0),
                 buffer_bytes: int = 1 << 20, cut_after: int | None = None) -> None:
        self.target, self.one_way_s, self.buffer_bytes = target, one_way_s, buffer_bytes
        self.cut_after = cut_after
        self.bytes_to_client = 0
        self.bytes_to_target = 0
        self.connections = 0
        self._server = socket.create_server(listen)
        self._stopping = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="delay-proxy", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._server.getsockname()[:2]

    def url(self, scheme: str = "http") -> str:
        host, port = self.address
        return f"{scheme}://{host}:{port}"

    def _accept_loop(self) -> None:
        self._server.settimeout(0.5)
        while not self._stopping.is_set():
            try:
                client, _ = self._server.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError as exc:
                log.warning("delay proxy: cannot reach %s: %s", self.target, exc)
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self.connections += 1
                self._sockets.update((client, upstream))
            sent = [0]  # bytes this connection has forwarded towards the client
            open_directions = [2]  # both sockets close when both directions are done
            self._forward(client, upstream, None, open_directions)
            self._forward(upstream, client, sent, open_directions)

    def _forward(self, src: socket.socket, dst: socket.socket, sent: list[int] | None, open_directions: list[int]) -> None:
        pipe = _Pipe(self.buffer_bytes)
        threading.Thread(target=self._read, args=(src, pipe, dst), daemon=True).start()
        threading.Thread(target=self._write, args=(pipe, src, dst, sent, open_directions), daemon=True).start()

    def _read(self, src: socket.socket, pipe: _Pipe, dst: socket.socket) -> None:
        try:
            while data := src.recv(CHUNK):
                pipe.put(time.monotonic() + self.one_way_s, data)
        except OSError:
            pass
        pipe.close()

    def _write(self, pipe: _Pipe, src: socket.socket, dst: socket.socket, sent: list[int] | None,
               open_directions: list[int]) -> None:
        try:
            while (item := pipe.get()) is not None:
                due, data = item
                if (wait := due - time.monotonic()) > 0:
                    time.sleep(wait)
                data = self._account(data, sent)
                dst.sendall(data)
                if sent is not None and self.cut_after is not None and sent[0] >= self.cut_after:
                    raise ConnectionAbortedError("cut")
            dst.shutdown(socket.SHUT_WR)  # the other side's EOF, after the last delayed chunk
        except OSError:
            for s in (src, dst):  # a broken side breaks the whole connection, as a real link would
                _close(s)
        pipe.close()
        with self._lock:
            open_directions[0] -= 1
            done = open_directions[0] == 0
            if done:
                self._sockets.difference_update((src, dst))
        if done:
            for s in (src, dst):
                _close(s)

    def _account(self, data: bytes, sent: list[int] | None) -> bytes:
        with self._lock:
            if sent is None:
                self.bytes_to_target += len(data)
                return data
            if self.cut_after is not None:
                data = data[:max(0, self.cut_after - sent[0])]
            sent[0] += len(data)
            self.bytes_to_client += len(data)
            return data

    def close(self) -> None:
        self._stopping.set()
        _close(self._server)
        with self._lock:
            for s in self._sockets:
                _close(s)
        self._thread.join(timeout=2)

    def __enter__(self) -> "DelayProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
