"""Security against a real coordinator process: credentials, body digests, TLS, slow clients."""
from __future__ import annotations

import http.client
import json
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

import get_gateway_model

from protocol.client import CoordinatorClient, RetryPolicy
from protocol.credentials import local_token
from protocol.errors import TLSFailure, Unauthorized
from protocol.integrity import DIGEST_HEADER, digest_header
from protocol.schemas import EXPERT_HEADER, UPDATE_HEADER
from protocol.tensors import dumps
from tests.helpers import FINGERPRINT, expert_spec, make_adapter, random_like, run_main, update_meta

BASE = {"id": "tiny-test", "fingerprint": FINGERPRINT}


def register(url: str, token: str, worker_id: str, specialty: str) -> str:
    r = requests.post(f"{url}/api/v1/workers", json={"worker_id": worker_id, "specialty": specialty,
                                                     "base_model": BASE},
                      headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["token"]


def push(url: str, token: str | None, expert: str = "e", meta: dict | None = None,
         digest: str | None = "auto") -> requests.Response:
    body = dumps(random_like(make_adapter(), seed=3))
    headers = {UPDATE_HEADER: json.dumps(meta or update_meta(worker_id="w1"))}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if digest:
        headers[DIGEST_HEADER] = digest_header(body) if digest == "auto" else digest
    return requests.post(f"{url}/api/v1/experts/{expert}/updates", data=body, headers=headers, timeout=10)


def test_bad_credentials_and_digests_are_4xx_never_5xx(start_coordinator, tmp_path):
    proc, url = start_coordinator()
    join = (tmp_path / "coordinator" / "join_token").read_text().strip()
    admin = CoordinatorClient(url)  # finds the admin token the coordinator recorded for this machine
    admin.experts.create("e", make_adapter(), expert_spec())
    admin.experts.create("f", make_adapter(), expert_spec())
    w1 = register(url, join, "w1", "e")
    wrong_digest = update_meta(worker_id="w1")
    cases = {
        "missing token": (push(url, None), 401),
        "unknown token": (push(url, "fmwrk_" + "x" * 43), 401),
        "join token pushing": (push(url, join), 403),
        "other specialty": (push(url, w1, expert="f"), 403),
        "other worker's id": (push(url, w1, meta=update_meta(worker_id="w2")), 403),
        "wrong digest": (push(url, w1, meta=wrong_digest, digest="sha256=" + "0" * 64), 400),
        "malformed digest": (push(url, w1, digest="sha1=abc"), 400),
        "no digest from a worker": (push(url, w1, digest=None), 400),
    }
    admin.workers.revoke("w1")
    cases["revoked worker"] = (push(url, w1), 401)
    cases["revoked worker registering"] = (requests.post(
        f"{url}/api/v1/workers", json={"worker_id": "w1", "specialty": "e", "base_model": BASE},
        headers={"Authorization": f"Bearer {join}"}, timeout=10), 403)
    got = {name: (r.status_code, r.json()["error"]["code"]) for name, (r, _) in cases.items()}
    assert {name: status for name, (status, _) in got.items()} == {name: want for name, (_, want) in cases.items()}
    with pytest.raises(Exception, match="no update"):  # the damaged push left nothing behind
        admin.updates.status(wrong_digest["update_id"])
    assert admin.experts.get("e")["version"] == 0
    assert admin.health()["status"] == "ok"
    assert "Traceback" not in "".join(proc.log)


def wait_until_expired(url: str, token: str, timeout: float = 60.0) -> None:
    """Poll a read (no side effect) until the coordinator calls the token expired, not a fixed sleep."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = requests.get(f"{url}/api/v1/experts", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        if r.status_code == 401:
            assert r.json()["error"]["details"] == {"reason": "expired"}
            return
        time.sleep(0.2)
    raise AssertionError(f"the token did not expire within {timeout} s")


def test_expired_worker_token_is_401_and_the_client_renews_it(start_coordinator, tmp_path):
    _, url = start_coordinator("--token-ttl-hours", str(1.5 / 3600))
    join = (tmp_path / "coordinator" / "join_token").read_text().strip()
    remote = CoordinatorClient(url, token=join)  # a worker elsewhere, given only the join token
    remote.workers.register("w1", "e", BASE)
    remote.experts.create("e", make_adapter(), expert_spec())
    old = register(url, join, "w2", "e")
    wait_until_expired(url, old)
    r = push(url, old, meta=update_meta(worker_id="w2"))
    assert (r.status_code, r.json()["error"]["details"]) == (401, {"reason": "expired"})
    status = remote.updates.push("e", dumps(random_like(make_adapter(), seed=4)), update_meta(worker_id="w1"))
    assert status["status"] in ("pending", "applied")
    with pytest.raises(Unauthorized, match=r"token from --token"):
        CoordinatorClient(url, token="fmadm_wrong").experts.list()


def test_the_local_entry_is_withdrawn_when_the_coordinator_stops(start_coordinator):
    proc, url = start_coordinator()
    assert local_token(url)
    assert proc.stop() == 0
    assert local_token(url) is None


def run_tool(*args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """get_gateway_model.py's main() in this process (tests.helpers.run_main; the script's own process is
    tests/cli's), with ``extra_env`` set for the call: FEDMOE_CONFIG_DIR and FEDMOE_TOKEN are read when used."""
    code, stdout, stderr = run_main(get_gateway_model.main, *args, env=extra_env)
    return subprocess.CompletedProcess(["get_gateway_model.py", *args], code, stdout, stderr)


def test_remote_tool_needs_a_token_and_an_admin_can_revoke(start_coordinator, tmp_path):
    _, url = start_coordinator()
    admin_token = (tmp_path / "coordinator" / "admin_token").read_text().strip()
    register(url, (tmp_path / "coordinator" / "join_token").read_text().strip(), "w9", "e")
    elsewhere = {"FEDMOE_CONFIG_DIR": str(tmp_path / "empty-config")}  # as on another machine
    denied = run_tool("--coordinator-url", url, "--list-experts", extra_env=elsewhere)
    assert denied.returncode == 2 and denied.stderr.count("\n") == 1 and "needs a token" in denied.stderr
    revoked = run_tool("--coordinator-url", url, "--revoke-worker", "w9",
                       extra_env=elsewhere | {"FEDMOE_TOKEN": admin_token})
    assert revoked.returncode == 0 and "revoked worker w9" in revoked.stdout
    assert [(w["worker_id"], w["revoked"]) for w in CoordinatorClient(url).workers.list()] == [("w9", True)]


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out",
                    str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


def count_requests(client: CoordinatorClient) -> list[int]:
    """[number of HTTP requests the client has sent so far]; the requests still go out unchanged."""
    sent = [0]
    send = client.transport.session.request

    def counting(*args, **kwargs):
        sent[0] += 1
        return send(*args, **kwargs)

    client.transport.session.request = counting  # type: ignore[method-assign]
    return sent


def test_tls_with_ca_cert_works_and_without_it_fails_in_one_line(start_coordinator, tmp_path):
    cert, key = self_signed(tmp_path)
    _, url = start_coordinator("--tls-cert", str(cert), "--tls-key", str(key))
    assert url.startswith("https://")
    client = CoordinatorClient(url, ca_cert=cert)
    client.experts.create("e", make_adapter(), expert_spec())
    assert [e["name"] for e in client.experts.list()] == ["e"]
    untrusting = CoordinatorClient(url, retry=RetryPolicy(attempts=3, base_delay=1.0))
    attempts = count_requests(untrusting)
    with pytest.raises(TLSFailure, match=r"not trusted .*--ca-cert"):
        untrusting.health()
    assert attempts == [1]  # not retried: waiting would not fix it
    ok = run_tool("--coordinator-url", url, "--ca-cert", str(cert), "--list-experts")
    assert ok.returncode == 0 and ok.stdout.startswith("name")
    bad = run_tool("--coordinator-url", url, "--list-experts")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--ca-cert" in bad.stderr


def test_a_stalled_client_is_cut_off_by_the_socket_timeout(start_coordinator):
    proc, url = start_coordinator("--socket-timeout", "1")
    address = urlsplit(url).hostname, urlsplit(url).port
    token = local_token(url)
    # headers that stop arriving: the connection is closed, the thread freed
    stalled = socket.create_connection(address, timeout=20)
    stalled.sendall(b"GET /api/v1/experts HTTP/1.1\r\nHost: x\r\n")
    assert stalled.recv(1024) == b""  # closed by the server: our own 20 s timeout would raise instead
    # a body that stops arriving: 408 with a JSON error, nothing stored
    spec = json.dumps(expert_spec())
    slow = socket.create_connection(address, timeout=20)
    slow.sendall(f"PUT /api/v1/experts/e HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                 f"{EXPERT_HEADER}: {spec}\r\nContent-Length: 100000\r\n\r\n".encode() + b"x" * 10)
    answer = http.client.HTTPResponse(slow)  # within slow's 20 s timeout, or it raises
    answer.begin()
    assert (answer.status, json.loads(answer.read())["error"]["code"]) == (408, "request_timeout")
    assert CoordinatorClient(url).experts.list() == []
    assert "Traceback" not in "".join(proc.log)


class RateLimitedServer:
    """Answers 429 with Retry-After: 1 to the first request, then 200."""

    def __init__(self) -> None:
        self.seen: list[float] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.seen.append(time.monotonic())
                limited = len(outer.seen) == 1
                body = json.dumps({"error": {"code": "too_many_requests", "message": "slow down"}} if limited
                                  else {"status": "ok"}).encode()
                self.send_response(429 if limited else 200)
                if limited:
                    self.send_header("Retry-After", "1")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_the_client_waits_as_long_as_retry_after_says():
    server = RateLimitedServer()
    try:
        fast = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.02)  # backoff alone would retry at once
        assert CoordinatorClient(server.url, retry=fast, token="t").health() == {"status": "ok"}
        assert len(server.seen) == 2 and server.seen[1] - server.seen[0] >= 1.0
    finally:
        server.server.shutdown()
        server.server.server_close()
