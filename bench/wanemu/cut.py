"""A loopback TCP proxy that breaks an upload once, after a given number of bytes, and counts what crossed.

``DelayProxy(cut_after=N)`` cuts downloads (bytes towards the client, on every connection); this one
cuts uploads: the connection that carries byte ``cut_at`` towards the target (counted over all
connections, headers included) is closed on both sides after forwarding exactly ``cut_at`` bytes, once;
later connections pass. ``on_cut`` runs in the proxy's thread before the client sees the break (e.g.
to kill and restart the target, then ``retarget`` to it). ``rate_mbit`` paces the upload direction in
userspace (no root needed), so a break at 90% happens mid-transfer as it would on a slow link.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

CHUNK = 64 * 1024


class CutProxy:
    def __init__(self, target: tuple[str, int], cut_at: int | None = None, rate_mbit: float | None = None,
                 on_cut: Callable[[], None] | None = None) -> None:
        self.target, self.cut_at, self.on_cut = target, cut_at, on_cut
        self.rate = rate_mbit * 1e6 / 8 if rate_mbit else None  # bytes per second
        self.bytes_to_target = 0
        self.bytes_after_cut = 0
        """Bytes sent towards the target after the cut (what resuming cost, headers included)."""
        self.connections = 0
        self.cuts = 0
        self._lock = threading.Lock()
        self._cutting = threading.Lock()  # held while on_cut runs: no new connection, no news of the break
        self._sockets: set[socket.socket] = set()
        self._server = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept_loop, name="cut-proxy", daemon=True).start()

    @property
    def address(self) -> tuple[str, int]:
        return self._server.getsockname()[:2]

    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def retarget(self, target: tuple[str, int]) -> None:
        """Send new connections to ``target`` (a restarted server on another port)."""
        self.target = target

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                with self._cutting:
                    target = self.target
                upstream = socket.create_connection(target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self.connections += 1
                self._sockets.update((client, upstream))
            threading.Thread(target=self._up, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket) -> None:
        started, sent_here = time.monotonic(), 0
        try:
            while data := client.recv(CHUNK):
                data, cut = self._take(data)
                if self.rate:  # pace: this connection's bytes never run ahead of the rate
                    sent_here += len(data)
                    if (ahead := sent_here / self.rate - (time.monotonic() - started)) > 0:
                        time.sleep(ahead)
                upstream.sendall(data)
                if cut:
                    if self.on_cut is not None:
                        with self._cutting:
                            self.on_cut()
                    break
            else:
                upstream.shutdown(socket.SHUT_WR)
                return
        except OSError:
            pass
        _close(client, upstream)

    def _take(self, data: bytes) -> tuple[bytes, bool]:
        """The part of ``data`` to forward, and whether the connection is to be cut after it."""
        with self._lock:
            if self.cuts:
                self.bytes_after_cut += len(data)
            elif self.cut_at is not None and self.bytes_to_target + len(data) >= self.cut_at:
                data = data[:self.cut_at - self.bytes_to_target]
                self.bytes_to_target += len(data)
                self.cuts += 1
                return data, True
            self.bytes_to_target += len(data)
            return data, False

    def _down(self, upstream: socket.socket, client: socket.socket) -> None:
        try:
            while data := upstream.recv(CHUNK):
                client.sendall(data)
        except OSError:
            pass
        with self._cutting:  # a target that on_cut is killing: the client hears of it once on_cut is done
            _close(client, upstream)

    def close(self) -> None:
        self._server.close()
        with self._lock:
            sockets = list(self._sockets)
        _close(*sockets)

    def __enter__(self) -> "CutProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close(*sockets: socket.socket) -> None:
    for s in sockets:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
