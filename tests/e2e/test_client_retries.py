"""The client's retry behaviour against real HTTP servers on loopback."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from protocol.client import CoordinatorClient, RetryPolicy
from protocol.errors import Conflict, Unavailable


class FlakyServer:
    """Answers the first ``failures`` requests with ``status``, then 200 {"status": "ok"}."""

    def __init__(self, failures: int, status: int = 503) -> None:
        self.failures, self.status, self.seen = failures, status, 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.seen += 1
                code = outer.status if outer.seen <= outer.failures else 200
                body = json.dumps({"status": "ok"} if code == 200 else
                                  {"error": {"code": "conflict", "message": "no"}}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def flaky():
    servers = []

    def make(failures: int, status: int = 503) -> FlakyServer:
        servers.append(FlakyServer(failures, status))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


FAST = RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05)


def test_5xx_answers_are_retried_until_success(flaky):
    server = flaky(failures=3)
    assert CoordinatorClient(server.url, retry=FAST).health() == {"status": "ok"}
    assert server.seen == 4


def test_gives_up_after_the_configured_attempts(flaky):
    server = flaky(failures=10)
    with pytest.raises(Unavailable, match="HTTP 503.*gave up after 4 tries"):
        CoordinatorClient(server.url, retry=FAST).health()
    assert server.seen == 4


def test_4xx_is_not_retried_and_maps_to_the_servers_error(flaky):
    server = flaky(failures=1, status=409)
    with pytest.raises(Conflict, match="no"):
        CoordinatorClient(server.url, retry=FAST).health()
    assert server.seen == 1


def test_backoff_grows_and_is_capped():
    policy = RetryPolicy(base_delay=0.5, max_delay=2.0)
    assert all(0 <= policy.delay(0) <= 0.5 for _ in range(100))
    assert all(0 <= policy.delay(10) <= 2.0 for _ in range(100))
    assert max(policy.delay(3) for _ in range(200)) > 1.0  # jitter spans the range
