"""Audit finding: a worker that joined with the join token (the README's several-machines path, FEDMOE_TOKEN=fmjoin_)
sent every heartbeat with the join token, and the coordinator refused each one with 403 (and wrote an audit row).

Sent: ``CoordinatorClient(url, token=<join token>)``, ``register_worker(...)``, then ``heartbeat(worker_id)``.
Came back: 403 "the join token can only register workers and read" (the relay logged 18 in 90 s of one worker):
``_token_for(worker, expert=None)`` compared the worker token's specialty with None and fell back to the join token.
Fix: ``Workers.token_for`` in protocol/client/workers.py (a call that names no expert uses the worker's own token).
"""
from __future__ import annotations

import threading

import pytest
from werkzeug.serving import make_server

from coordinator.api.app import create_app
from coordinator.config import CoordinatorConfig
from protocol.client import CoordinatorClient
from tests.helpers import FINGERPRINT


@pytest.fixture
def root(tmp_path):
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "root", gateway_interval=0))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", (tmp_path / "root" / "join_token").read_text().strip(), app
    server.shutdown()
    server.server_close()
    app.extensions["fedmoe"].close()


def test_a_worker_that_joined_with_the_join_token_heartbeats_with_its_own_token(root):
    url, join, app = root
    client = CoordinatorClient(url, token=join)
    client.workers.register("w1", "sql_expert", {"id": "m", "fingerprint": FINGERPRINT}, 5.0)

    client.workers.heartbeat("w1")  # was Forbidden: sent with the join token

    assert client.workers.token_for("w1", None)[1] == "w1"
    assert client.workers.token_for("w1", "sql_expert")[1] == "w1"
    assert client.workers.token_for("w1", "other_expert") == (join, None)  # another expert's call is not this token's


def test_a_coordinator_that_answered_plain_http_is_not_probed_for_tls_when_it_drops_a_connection():
    """After a dropped connection the client asks whether the port speaks TLS (a clear "use https://" instead of
    retries), but only of a coordinator that never answered it in plain HTTP: each probe is a TLS handshake that
    the coordinator's log showed as a 400 "Bad request version" (seen in bench.wan's root log)."""
    import socket


    from protocol.client import RetryPolicy
    from protocol.errors import Unavailable

    listener = socket.create_server(("127.0.0.1", 0))
    port, connections = listener.getsockname()[1], []

    def serve() -> None:
        for n in range(100):
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            first = conn.recv(4096)
            connections.append(first[:1])
            if n == 0:  # the first request is answered in plain HTTP; every later connection is dropped at once
                body = b'{"status": "ok"}'
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    client = CoordinatorClient(f"http://127.0.0.1:{port}", retry=RetryPolicy(attempts=2, base_delay=0.01),
                               timeout=(2.0, 2.0))
    try:
        client.health()
        with pytest.raises(Unavailable):
            client.health()
    finally:
        listener.close()
        client.close()
    assert len(connections) == 3  # one answered, two dropped tries: no TLS handshake among them
    assert b"\x16" not in connections  # a TLS ClientHello starts with the handshake record type 0x16
