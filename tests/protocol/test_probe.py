"""Link probes and the client's choice among several coordinators (protocol/probe.py), on real servers."""
from __future__ import annotations

import threading
from dataclasses import replace

import pytest
from werkzeug.serving import make_server

from coordinator.api.app import create_app
from coordinator.config import CoordinatorConfig
from protocol.client import CoordinatorClient, RetryPolicy
from protocol.errors import Unavailable
from protocol.probe import LinkEstimate, probe, rank, split_urls


class Server:
    """A real coordinator app on a loopback port, in a thread; ``stop`` and ``start`` keep the port."""

    def __init__(self, data_dir, port: int = 0) -> None:
        self.app = create_app(CoordinatorConfig(data_dir=data_dir, auth=False, gateway_interval=0))
        self.port = port
        self.start()

    def start(self) -> None:
        self.server = make_server("127.0.0.1", self.port, self.app, threaded=True)
        self.port = self.server.server_port
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def servers(tmp_path):
    made = [Server(tmp_path / "a"), Server(tmp_path / "b")]
    yield made
    for s in made:
        s.stop()
        s.app.extensions["fedmoe"].close()


def test_probe_measures_a_live_server_and_marks_a_dead_one(servers):
    live = probe(servers[0].url, pings=2, download_bytes=64 << 10)
    assert live.reachable and 0 < live.rtt < 5 and live.throughput > 0
    servers[1].stop()
    dead = probe(servers[1].url, pings=1, timeout=1)
    assert not dead.reachable and dead.sync_seconds(1000) == float("inf")
    servers[1].start()


def test_rank_weighs_round_trips_against_bytes():
    near_slow = LinkEstimate("near", rtt=0.002, throughput=2.5e6)  # a relay on a slow uplink
    far_fast = LinkEstimate("far", rtt=0.05, throughput=1e9)  # the root, far away but fast
    dead = LinkEstimate("dead", float("inf"), 0.0, error="ConnectionError")
    assert [e.url for e in rank([dead, far_fast, near_slow], sync_bytes=100_000)] == ["near", "far", "dead"]
    assert [e.url for e in rank([near_slow, far_fast], sync_bytes=50_000_000)] == ["far", "near"]
    assert split_urls("http://a/, http://b,,http://a") == ["http://a", "http://b"]


def test_the_client_joins_the_best_fails_over_and_fails_back(servers):
    a, b = servers

    # Real measurements, b made to look 1000 s worse per round trip: a loaded machine (seconds per request, seen
    # with 1 s here) can neither time a live server out nor rank b first; a stopped one still refuses at once.
    def prober(url: str) -> LinkEstimate:
        measured = probe(url, pings=1, download_bytes=1024, timeout=60)
        return replace(measured, rtt=measured.rtt + 1000.0) if url == b.url else measured

    client = CoordinatorClient(f"{a.url},{b.url}", retry=RetryPolicy(attempts=1), failback_seconds=3600,
                               prober=prober)
    assert client.base_url == a.url
    assert client.health()["status"] == "ok"
    a.stop()
    assert client.health()["status"] == "ok" and client.base_url == b.url  # failed over within the call
    a.start()
    client.transport.failback_seconds = 0  # the next call re-probes
    client.health()
    assert client.base_url == a.url
    a.stop()
    b.stop()
    with pytest.raises(Unavailable):
        client.health()
    a.start()
    b.start()
