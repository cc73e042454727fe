"""Large request bodies through the buffering front (coordinator/http/front.py): read straight into buffers
(DirectBody) yet byte for byte what was sent, hashed as it arrived, never past its end."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from protocol.integrity import content_id, new_hasher

ROOT = Path(__file__).resolve().parents[2]
SERVER = """
import hashlib, json, socket, ssl, sys
from pathlib import Path
from coordinator.http.front import BufferingFront
from coordinator.http.options import FrontOptions
from coordinator.http.wsgi import SPOOLED_BODY

def app(environ, start_response):
    spooled = environ.get(SPOOLED_BODY)
    data = spooled.path.read_bytes() if spooled is not None else environ["wsgi.input"].read()
    answer = json.dumps({"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                         "spooled_digest": spooled.digest if spooled is not None else None,
                         "read_by": dict(front.shared.bodies_read)}).encode()
    start_response("200 OK", [("Content-Type", "application/json")])
    return [answer]

sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(64)
tls = None
if len(sys.argv) > 3:
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(sys.argv[3], sys.argv[4])
Path(sys.argv[1]).write_text(str(sock.getsockname()[1]))
front = BufferingFront(app, sock, FrontOptions(threads=2, socket_timeout=float(sys.argv[2]),
                                               spool_dir=Path(sys.argv[1]).parent), tls)
front.run()
"""


@pytest.fixture
def front(tmp_path):
    """Start a front serving a body-describing app; yields a function (timeout, tls files) -> port."""
    started = []

    def start(timeout: float = 30.0, tls: tuple[Path, Path] | None = None) -> int:
        port_file = tmp_path / f"port{len(started)}"
        args = [sys.executable, "-c", SERVER, str(port_file), str(timeout), *(map(str, tls or ()))]
        started.append(subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}))
        while not (port_file.exists() and port_file.read_text()):
            assert started[-1].poll() is None, "the front exited"
            time.sleep(0.02)
        return int(port_file.read_text())

    start.pid = lambda: started[-1].pid  # type: ignore[attr-defined]  # the last front's process
    yield start
    for proc in started:
        proc.terminate()
        proc.wait(30)


def request(size: int, body: bytes, extra: bytes = b"", digest: str | None = None) -> bytes:
    headers = f"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: {size}\r\n"
    if digest:
        headers += f"X-FedMoE-Digest: blake3={digest}\r\n"
    return headers.encode() + b"\r\n" + body + extra


def read_answer(f) -> dict:
    status = f.readline()
    assert status.startswith(b"HTTP/1.1 200"), status
    length = 0
    while (line := f.readline()) != b"\r\n":
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    return json.loads(f.read(length))


def blake3_id(data: bytes) -> str:
    hasher = new_hasher("blake3", len(data))
    hasher.update(data)
    return content_id("blake3", hasher.hexdigest())


@pytest.mark.parametrize("size", [256 << 10, (1 << 20) + 1, 4_675_401, 3 << 20])
def test_a_large_body_arrives_whole_and_hashed_and_the_next_request_follows(front, size):
    """Two requests in one write (the second pipelined right behind the body): the direct read stops at
    the body's end, the spooled digest is the body's, and the next request is read from where it stopped."""
    port = front()
    first, second = os.urandom(size), os.urandom(1000)
    with socket.create_connection(("127.0.0.1", port)) as s, s.makefile("rb") as f:
        s.sendall(request(size, first, request(len(second), second), digest=blake3_id(first)[3:]))
        answer = read_answer(f)
        assert answer["size"] == size and answer["sha256"] == hashlib.sha256(first).hexdigest()
        assert answer["spooled_digest"] in (None, blake3_id(first))
        assert (answer["spooled_digest"] is not None) == (size > 1 << 20)  # spooled past 1 MiB
        # a spooled body is read by a body thread when one is free (here: always), never by the loop
        assert answer["read_by"] == ({"thread": 1, "loop": 0} if size > 1 << 20 else {"thread": 0, "loop": 1})
        second_answer = read_answer(f)
        assert {k: second_answer[k] for k in ("size", "sha256", "spooled_digest")} == {
            "size": 1000, "sha256": hashlib.sha256(second).hexdigest(), "spooled_digest": None}


def test_a_chunked_body_is_read_by_h11_and_the_request_behind_it_is_the_next(front):
    """The chunked framing (extensions, a trailer) is read by the h11 connection that parsed the head; what comes
    after the last chunk in the same packet is the next request, not lost in h11's buffer."""
    port = front()
    parts = [os.urandom(70_000), os.urandom(1_200_000), b"x"]
    chunked = b"".join(b"%x;ext=1\r\n%b\r\n" % (len(p), p) for p in parts) + b"0\r\nX-Trailer: t\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as s, s.makefile("rb") as f:
        s.sendall(b"POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
                  + request(3, b"abc"))
        whole = b"".join(parts)
        answer = read_answer(f)
        assert answer["size"] == len(whole) and answer["sha256"] == hashlib.sha256(whole).hexdigest()
        assert read_answer(f)["sha256"] == hashlib.sha256(b"abc").hexdigest()


def test_a_body_sent_in_small_pieces_is_assembled_in_order(front):
    port = front()
    body = os.urandom(3 << 20)
    with socket.create_connection(("127.0.0.1", port)) as s, s.makefile("rb") as f:
        s.sendall(request(len(body), b""))
        for start in range(0, len(body), 100_003):  # pieces that straddle the 1 MiB buffers
            s.sendall(body[start:start + 100_003])
        assert read_answer(f)["sha256"] == hashlib.sha256(body).hexdigest()


def test_a_body_slower_than_the_threads_stall_is_finished_by_the_loop(front):
    """A body thread gives up on a piece that has not arrived within its stall time (min(timeout, 2 s)); the loop
    reads the rest of the body, which is still spooled whole and hashed in order."""
    port = front(timeout=3.0)  # body thread stall: 2 s; then the loop's own 3 s per MiB
    body = os.urandom((2 << 20) + 4321)
    with socket.create_connection(("127.0.0.1", port)) as s, s.makefile("rb") as f:
        s.sendall(request(len(body), body[:1_500_000], digest=blake3_id(body)[3:]))
        time.sleep(2.6)  # the thread has its first MiB and waits for the second in vain
        s.sendall(body[1_500_000:])
        answer = read_answer(f)
    assert answer["sha256"] == hashlib.sha256(body).hexdigest() and answer["spooled_digest"] == blake3_id(body)
    assert answer["read_by"] == {"thread": 0, "loop": 1}  # counted once, as finished by the loop


def test_a_client_gone_mid_body_costs_only_its_connection(front):
    port = front()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(request(4 << 20, os.urandom(2 << 20)))  # half the body, then gone
    body = os.urandom(2 << 20)
    with socket.create_connection(("127.0.0.1", port)) as s, s.makefile("rb") as f:
        s.sendall(request(len(body), body))
        assert read_answer(f)["sha256"] == hashlib.sha256(body).hexdigest()


def test_a_body_that_stalls_is_answered_408(front):
    port = front(timeout=1.0)
    with socket.create_connection(("127.0.0.1", port)) as s, s.makefile("rb") as f:
        s.sendall(request(4 << 20, os.urandom(3 << 20)))  # most of it, then nothing
        s.settimeout(60)
        status = f.readline()
        assert status.startswith(b"HTTP/1.1 408"), status
        assert b"request_timeout" in f.read()


def test_a_large_body_over_tls(front, tmp_path):
    from tests.e2e.test_security import self_signed
    cert, key = self_signed(tmp_path)
    port = front(tls=(cert, key))
    context = ssl.create_default_context(cafile=str(cert))
    body = os.urandom((2 << 20) + 12345)
    with socket.create_connection(("127.0.0.1", port)) as raw, context.wrap_socket(raw, server_hostname="127.0.0.1") as s, \
            s.makefile("rb") as f:
        s.sendall(request(len(body), body, request(3, b"abc")))
        answer = read_answer(f)
        assert answer["sha256"] == hashlib.sha256(body).hexdigest()
        assert answer["read_by"] == {"thread": 0, "loop": 1}  # TLS bodies stay on the loop (records, not bytes)
        assert read_answer(f)["size"] == 3


def test_idle_tls_connections_hold_little_memory(front, tmp_path):
    """TLS is done by the front's own protocol over memory BIOs (coordinator/http/wire.py): an idle TLS connection
    holds its OpenSSL session, not asyncio's 256 KiB read buffer (which a process-wide patch of the private
    ``SSLProtocol.max_size`` cut to 64 KiB until issue 31: 92 KiB per connection measured, 22 KiB now)."""
    from tests.e2e.test_security import self_signed
    cert, key = self_signed(tmp_path)
    port = front(tls=(cert, key))
    context = ssl.create_default_context(cafile=str(cert))

    def answered() -> ssl.SSLSocket:  # one request answered, then idle and kept alive
        s = context.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1")
        s.sendall(request(3, b"abc"))
        read_answer(s.makefile("rb"))
        return s

    held = [answered()]  # the front's first request: its one-time costs are not what this measures
    pid = front.pid()
    before = _rss_kib(pid)
    held += [answered() for _ in range(200)]
    per_connection = (_rss_kib(pid) - before) / 200
    for s in held:
        s.close()
    assert per_connection < 48, f"{per_connection:.0f} KiB per idle TLS connection"


def _rss_kib(pid: int) -> int:
    return int(next(line.split()[1] for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS")))


# read_on_thread on its own: a socket pair, a real spool in tmp_path

def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """(server side, client side) of a loopback TCP connection, the server side non-blocking as the loop has it."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    server.setblocking(False)
    return server, client


def _spool(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from coordinator.http.bodies import Spool
    return Spool(tmp_path, "blake3", 0, ThreadPoolExecutor(1))


def test_a_body_thread_reads_exactly_the_body_and_leaves_the_socket_non_blocking(tmp_path):
    """The bytes after the body stay in the socket for the loop, and the socket the loop shares is non-blocking
    again (a blocking one would let a slow reader of a large answer stall every connection)."""
    from coordinator.http.bodies import read_on_thread
    body = os.urandom((3 << 20) + 777)
    server, client = _tcp_pair()
    with server, client:
        spool = _spool(tmp_path)
        sender = threading.Thread(target=client.sendall, args=(body[100:] + b"NEXT",))
        sender.start()
        got = read_on_thread(server.fileno(), spool, body[:100], len(body) - 100, bytearray(1 << 20), 5.0)
        sender.join()
        assert got == len(body) - 100
        assert not os.get_blocking(server.fileno())
        assert server.recv(10) == b"NEXT"  # not read by the thread
        spool.file.flush()
        assert spool.path.read_bytes() == body
        assert content_id("blake3", spool.hasher.hexdigest()) == blake3_id(body)
        spool.discard()
        assert not spool.path.exists()


def test_a_body_thread_gives_a_stalled_body_back_with_what_it_read(tmp_path):
    from coordinator.http.bodies import read_on_thread
    server, client = _tcp_pair()
    with server, client:
        spool = _spool(tmp_path)
        part = os.urandom(300_000)
        client.sendall(part)  # then nothing
        got = read_on_thread(server.fileno(), spool, b"", 2 << 20, bytearray(1 << 20), 0.3)
        assert got == len(part) and not os.get_blocking(server.fileno())
        spool.file.flush()
        assert spool.path.read_bytes() == part
        spool.discard()


def test_a_body_thread_reports_a_client_that_went_away(tmp_path):
    import asyncio

    from coordinator.http.bodies import read_on_thread
    server, client = _tcp_pair()
    with server:
        client.sendall(b"x" * 1000)
        client.close()
        spool = _spool(tmp_path)
        with pytest.raises(asyncio.IncompleteReadError):
            read_on_thread(server.fileno(), spool, b"", 5000, bytearray(1 << 20), 5.0)
        assert not os.get_blocking(server.fileno())
        spool.discard()
