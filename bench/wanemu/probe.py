"""Link measurements: a loopback test server and the client that runs inside a site.

``python -m bench.wanemu.probe HOST PORT`` (run inside the namespace) prints one JSON line:
median ping-pong RTT, download and upload throughput, measured against ``ProbeServer``.
"""
from __future__ import annotations

import json
import socket
import statistics
import struct
import sys
import threading
import time

CHUNK = 64 * 1024


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = sock.recv(min(CHUNK, n - len(buf)))
        if not data:
            raise ConnectionError("peer closed")
        buf += data
    return bytes(buf)


def _drain(sock: socket.socket, n: int) -> None:
    while n > 0:
        data = sock.recv(min(CHUNK, n))
        if not data:
            raise ConnectionError("peer closed")
        n -= len(data)


class ProbeServer:
    """On loopback: 'P' -> one byte back; 'D'+len -> len bytes; 'U'+len -> read len, one byte back."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> tuple[str, int]:
        return self._server.getsockname()[:2]

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        block = bytes(CHUNK)
        try:
            while op := conn.recv(1):
                if op == b"P":
                    conn.sendall(b"p")
                elif op == b"D":
                    (n,) = struct.unpack("!Q", _recv_exact(conn, 8))
                    for start in range(0, n, CHUNK):
                        conn.sendall(block[:min(CHUNK, n - start)])
                elif op == b"U":
                    (n,) = struct.unpack("!Q", _recv_exact(conn, 8))
                    _drain(conn, n)
                    conn.sendall(b"u")
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._server.close()


def measure(host: str, port: int, pings: int = 20, transfer_bytes: int = 8 << 20) -> dict[str, float]:
    """RTT (median of ``pings`` ping-pongs) and throughput both ways through the link, in ms and Mbit/s."""
    with socket.create_connection((host, port), timeout=60) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(pings):
            t = time.perf_counter()
            sock.sendall(b"P")
            _recv_exact(sock, 1)
            rtts.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        sock.sendall(b"D" + struct.pack("!Q", transfer_bytes))
        _drain(sock, transfer_bytes)
        down = time.perf_counter() - t
        t = time.perf_counter()
        sock.sendall(b"U" + struct.pack("!Q", transfer_bytes))
        block = bytes(CHUNK)
        for start in range(0, transfer_bytes, CHUNK):
            sock.sendall(block[:min(CHUNK, transfer_bytes - start)])
        _recv_exact(sock, 1)
        up = time.perf_counter() - t
    mbit = transfer_bytes * 8 / 1e6
    return {"rtt_ms_median": statistics.median(rtts), "rtt_ms_min": min(rtts),
            "download_mbit_s": mbit / down, "upload_mbit_s": mbit / up}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), transfer_bytes=int(sys.argv[3]) if len(sys.argv) > 3 else 8 << 20)))
