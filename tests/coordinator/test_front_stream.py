"""Answers of unknown length through the buffering front (coordinator/http/front.py): sent as they are made, chunked, and
the application told when the client goes away (serve.py's server-sent events ride on this).

The app's generator waits between its chunks for a file that only the client creates once it has read the first
chunk: the test cannot pass unless the first chunk is written before the generator makes the second (no timing).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVER = """
import socket, sys, time
from pathlib import Path
from coordinator.http.front import BufferingFront
from coordinator.http.options import FrontOptions

here = Path(sys.argv[1]).parent

def app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/event-stream")])
    return events()

def events():
    try:
        yield b"data: one\\n\\n"
        while not (here / "go").exists():  # made by the client once it has read the first event
            time.sleep(0.01)
        yield b"data: two\\n\\n"
        while not (here / "end").exists():
            time.sleep(0.01)
        yield b"data: [DONE]\\n\\n"
    except GeneratorExit:
        (here / "closed").write_text("client gone")
        raise

sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(8)
Path(sys.argv[1]).write_text(str(sock.getsockname()[1]))
BufferingFront(app, sock, FrontOptions(threads=2, socket_timeout=30)).run()
"""


@pytest.fixture
def stream_front(tmp_path):
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port_file)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    while not (port_file.exists() and port_file.read_text()):
        assert proc.poll() is None, "the front exited"
        time.sleep(0.02)
    yield int(port_file.read_text()), tmp_path
    proc.terminate()
    proc.wait(30)


def read_until(sock: socket.socket, marker: bytes, got: bytes = b"") -> bytes:
    while marker not in got:
        piece = sock.recv(65536)
        assert piece, f"closed before {marker!r}; got {got!r}"
        got += piece
    return got


def test_each_chunk_is_sent_when_the_app_yields_it_then_the_connection_serves_the_next_request(stream_front):
    port, here = stream_front
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /events HTTP/1.1\r\nHost: h\r\n\r\n")
        got = read_until(sock, b"data: one")  # while the app still waits for "go"
        head = got.split(b"\r\n\r\n", 1)[0]
        assert b"Transfer-Encoding: chunked" in head and b"Content-Length" not in head
        assert b"Connection: keep-alive" in head
        (here / "go").write_text("")
        got = read_until(sock, b"data: two", got)
        (here / "end").write_text("")
        got = read_until(sock, b"0\r\n\r\n", got)
        body = got.split(b"\r\n\r\n", 1)[1]
        assert body == (b"b\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        sock.sendall(b"GET /again HTTP/1.1\r\nHost: h\r\n\r\n")  # kept alive: a second stream on it
        assert b"data: one" in read_until(sock, b"data: [DONE]")
    assert not (here / "closed").exists()  # both streams ended by themselves


def test_a_client_gone_mid_stream_closes_the_apps_generator(stream_front):
    port, here = stream_front
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /events HTTP/1.1\r\nHost: h\r\n\r\n")
        read_until(sock, b"data: one")
    (here / "go").write_text("")  # the app yields "two" into a closed connection: the front closes the generator
    deadline = time.monotonic() + 60
    while not (here / "closed").exists():
        assert time.monotonic() < deadline, "the generator was never closed"
        time.sleep(0.05)


def test_http_1_0_gets_the_stream_unframed_ended_by_the_close(stream_front):
    port, here = stream_front
    (here / "go").write_text("")
    (here / "end").write_text("")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /events HTTP/1.0\r\n\r\n")
        got = b""
        while piece := sock.recv(65536):
            got += piece
    head, body = got.split(b"\r\n\r\n", 1)
    assert b"Connection: close" in head and b"chunked" not in head
    assert body == b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
