"""Hostile clients on the routes added since bench/hostile.py was written: ``POST /api/v1/probe``, resumable
uploads, ``?since=`` diffs, Range pulls, the relay's API, plus malformed HTTP framing, against a real root AND a
real relay (the ``new_surface`` part of ``python -m bench.hostile``).

Per server: every request of the matrix (bad tokens and scopes on each new route, garbage ``since``/``bytes``/
Range, unicode and path tricks in expert names and upload ids, Content-Length and chunked-size lies, header
floods) with its status, counted as ``unexpected`` when it is a 5xx, gets no answer, or is a 4xx without a JSON
error; then ``--connections``-sized slow clients on the probe and on an upload chunk (bench/slow_clients.py
kinds) while a normal client pushes and pulls through the relay; then 64 concurrent 4 MiB probes (peak RSS and
data-dir growth). Findings of the audit that are not fixed yet (tests/e2e/test_audit_front.py, xfail) show up
as ``known_open`` rather than failures, so a fix moves them to ``ok``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from bench.common import CoordinatorProcess, format_table
from bench import attacks
from bench.attacks import is_json_error
from bench.slow_clients import Attack
from protocol.schemas import EXPERT_HEADER
from protocol.tensors import dumps
from bench.updates import FINGERPRINT, expert_spec, make_adapter, random_like, update_meta

MiB = 1 << 20
EXPERT = "python_expert"
# requests a finding answers wrongly while it is open, by case name (empty: the audit's findings are fixed; their
# tests are tests/e2e/test_audit_front.py, tests/coordinator/test_audit_relay.py)
KNOWN_OPEN: dict[str, str] = {}
EXPECTED = {"chunked size -1": (400,), "chunk-size line over the head limit": (400,),
            "Transfer-Encoding gzip": (400,), "Transfer-Encoding chunked, gzip": (400,),
            "expert name 'python_expert?x=1' weights": (400, 404)}
"""Statuses that must be one of these (any other 4xx is a wrong answer too)."""

log = logging.getLogger("bench.hostile")


def raw_request(port: int, data: bytes, timeout: float = 20.0) -> tuple[int | None, bytes]:
    """Send ``data`` on a fresh connection; (status, body) of the first answer, (None, b"") if none came."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
        except OSError:
            pass  # the server answered and closed while we were still sending
        answer = b""
        try:
            while b"\r\n\r\n" not in answer and (piece := sock.recv(65536)):
                answer += piece
            head, _, body = answer.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length and (piece := sock.recv(65536)):
                body += piece
        except OSError:
            pass
    first = answer.split(b"\r\n", 1)[0].split()
    return (int(first[1]) if len(first) > 1 and first[0].startswith(b"HTTP/") else None), body


def raw_cases(token: str) -> dict[str, bytes]:
    """Framing attacks on the probe (the route that reads a body with any token), and head floods."""
    probe = f"POST /api/v1/probe HTTP/1.1\r\nHost: b\r\nAuthorization: Bearer {token}\r\n"
    chunked = probe + "Transfer-Encoding: chunked\r\n\r\n"
    health = "GET /api/v1/health HTTP/1.1\r\nHost: b\r\n"
    cases = {
        "Content-Length -1": probe + "Content-Length: -1\r\n\r\n",
        "Content-Length abc": probe + "Content-Length: abc\r\n\r\n",
        "Content-Length 10**26": probe + "Content-Length: " + "9" * 26 + "\r\n\r\n",
        "two Content-Lengths": probe + "Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
        "Content-Length and chunked": probe + "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        "Content-Length smaller than the body": probe + "Content-Length: 2\r\n\r\nhelloGET / HTTP/1.1\r\n\r\n",
        "Transfer-Encoding gzip": probe + "Transfer-Encoding: gzip\r\n\r\nhello",
        "Transfer-Encoding chunked, gzip": probe + "Transfer-Encoding: chunked, gzip\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        "chunk size zz": chunked + "zz\r\nhello\r\n0\r\n\r\n",
        "chunked size -1": chunked + "-1\r\n" + "x" * 4096,
        "chunk size 2**80": chunked + "f" * 20 + "\r\nhello\r\n",
        "chunk without CRLF": chunked + "5\r\nhelloXX0\r\n\r\n",
        "chunk-size line over the head limit": chunked + "5;" + "a" * 200_000 + "\r\nhello\r\n0\r\n\r\n",
        "20,000 trailers": chunked + "0\r\n" + "X: y\r\n" * 20_000 + "\r\n",
        "200 KB header": health + "X: " + "a" * 200_000 + "\r\n\r\n",
        "20,000 headers": health + "X-A: b\r\n" * 20_000 + "\r\n",
        "header without colon": health + "Host b\r\n\r\n",
        "100 KB path": "GET /" + "a" * 100_000 + " HTTP/1.1\r\nHost: b\r\n\r\n",
        "HTTP/2.0 request line": "GET /api/v1/health HTTP/2.0\r\nHost: b\r\n\r\n",
        "60 KB bearer token": "GET /api/v1/experts HTTP/1.1\r\nHost: b\r\nAuthorization: Bearer " + "a" * 60_000
                              + "\r\n\r\n",
        "update header nested 30,000 deep": f"POST /api/v1/experts/{EXPERT}/updates HTTP/1.1\r\nHost: b\r\n"
                                            f"Authorization: Bearer {token}\r\nX-FedMoE-Update: {'[' * 30_000}\r\n"
                                            "Content-Length: 5\r\n\r\nhello",
    }
    return {name: text.encode("latin-1") for name, text in cases.items()}


class Matrix:
    """Requests and their answers on one server."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.cases: dict[str, dict[str, Any]] = {}

    def send(self, name: str, method: str, path: str, token: str | None = None, **kwargs: Any) -> None:
        headers = {**({"Authorization": f"Bearer {token}"} if token else {}), **kwargs.pop("headers", {})}
        try:
            r = requests.request(method, self.base + path, headers=headers, timeout=30, **kwargs)
        except requests.RequestException as exc:
            self.cases[name] = {"status": None, "error": type(exc).__name__}
            return
        self.cases[name] = {"status": r.status_code, "json_error": is_json_error(r.content) if r.status_code >= 400
                            else None}

    def record_raw(self, name: str, status: int | None, body: bytes) -> None:
        self.cases[name] = {"status": status, "json_error": is_json_error(body) if status and status >= 400 else None}

    def summary(self) -> dict[str, Any]:
        bad = sorted(n for n, c in self.cases.items() if c["status"] is None or c["status"] >= 500
                     or (c["status"] >= 400 and not c["json_error"]) or c["status"] not in EXPECTED.get(n, (c["status"],)))
        return {"requests": len(self.cases), "status_5xx": sum((c["status"] or 0) >= 500 for c in self.cases.values()),
                "unexpected": [n for n in bad if n not in KNOWN_OPEN],
                "known_open": {n: KNOWN_OPEN[n] for n in bad if n in KNOWN_OPEN}, "cases": self.cases}


def request_matrix(server: CoordinatorProcess, tokens: dict[str, str], own: str, other: str,
                   admin: str) -> dict[str, Any]:
    m = Matrix(server.url + "/api/v1")
    weights = f"/experts/{EXPERT}/weights"
    for value in ("abc", "-1", "1e9", "9" * 23, "", "0x10", " 1", "\u0663", "NaN"):
        m.send(f"since={value!r}", "GET", weights, own, params={"since": value})
    for key, value in (("codec", "nosuch"), ("codec_config", "{x"), ("codec_config", "[1]"), ("codec_config", "[" * 5000)):
        m.send(f"since=0 {key}={value[:12]!r}", "GET", weights, own, params={"since": "0", "codec": "fp16", key: value})
    ranges = ("bytes=abc", "bytes=5-1", "bytes=-0", "bytes=99999999999-", "items=0-1", "bytes=--1",
              "bytes=" + ",".join(f"{i}-{i}" for i in range(2000)))
    for value in ranges:
        m.send(f"Range {value[:24]!r}", "GET", weights, own, headers={"Range": value})
    m.send("If-Range garbage", "GET", weights, own, headers={"Range": "bytes=0-10", "If-Range": '"zz'})
    m.send("expert name 'python_expert?x=1' weights", "GET", f"/experts/{EXPERT}%3Fx=1/weights", admin)
    for name in ("..", "%2e%2e", "a%00b", "a%0a", "%E2%80%AE", "\uff21\uff22", "x" * 5000, "..%2F..%2Fetc", "\u0661\u0662"):
        m.send(f"expert name {name[:16]!r} weights", "GET", f"/experts/{name}/weights", admin)
        m.send(f"expert name {name[:16]!r} open upload", "POST", f"/experts/{name}/uploads", admin, json={})
    for upload_id in ("..", "%2e%2e", "x" * 5000, "a%00", "%E2%80%AE", "..%2F..%2Fblobs"):
        for method in ("GET", "PUT", "DELETE"):
            m.send(f"upload id {upload_id[:12]!r} {method}", method, f"/experts/{EXPERT}/uploads/{upload_id}", own,
                   data=b"x")
    for value in ("-1", "abc", "99999999", "", "4194305", "1e3"):
        m.send(f"GET probe bytes={value!r}", "GET", "/probe", params={"bytes": value})
    m.send("POST probe without a token", "POST", "/probe", data=b"x" * 10)
    m.send("POST probe 5 MiB chunked", "POST", "/probe", own, data=iter([b"x" * MiB] * 5))
    m.send("POST probe 5 MiB", "POST", "/probe", own, data=b"x" * (5 * MiB))
    routes = [("POST", f"/experts/{EXPERT}/uploads"), ("GET", f"/experts/{EXPERT}/uploads/abc"),
              ("PUT", f"/experts/{EXPERT}/uploads/abc"), ("POST", f"/experts/{EXPERT}/uploads/abc/complete"),
              ("DELETE", f"/experts/{EXPERT}/uploads/abc"), ("POST", "/relays"), ("POST", "/relays/r1/report"),
              ("GET", "/relays"), ("POST", "/forward"), ("GET", weights), ("PUT", f"/experts/{EXPERT}/profiles/x")]
    for method, path in routes:
        for label, token in (("no token", None), ("join token", tokens["join"]), ("another expert's", other),
                             ("unknown token", "fmwrk_" + "A" * 43)):
            m.send(f"{method} {path} with {label}", method, path, token, json={})
    port = int(server.url.rsplit(":", 1)[1])
    for name, data in raw_cases(own).items():
        m.record_raw(name, *raw_request(port, data))
    return m.summary()


def _memory_mib(pid: int) -> float:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return sum(int(fields[k].split()[0]) for k in ("RssAnon", "RssShmem")) / 1024


def _dir_mib(path: Path) -> float:
    total = 0
    for folder, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(folder, f)).st_size
            except OSError:
                pass  # removed meanwhile
    return total / MiB


class Peak:
    """Peak anonymous+shared memory of a process and size of a dir, sampled on a thread."""

    def __init__(self, pid: int, directory: Path) -> None:
        self.pid, self.directory = pid, directory
        self.base = (_memory_mib(pid), _dir_mib(directory))
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = (max(self.peak[0], _memory_mib(self.pid)), max(self.peak[1], _dir_mib(self.directory)))

    def growth(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {"memory_mib": round(self.peak[0] - self.base[0], 1), "data_dir_mib": round(self.peak[1] - self.base[1], 1)}


def probe_flood(server: CoordinatorProcess, token: str, concurrent: int = 64, rounds: int = 4) -> dict[str, Any]:
    """``concurrent`` 4 MiB upload probes at once, ``rounds`` times: peak memory and data-dir growth."""
    body = bytes(4 * MiB)
    peak = Peak(server.pid, server.data_dir)

    def probe(_: int) -> int:
        try:
            return requests.post(server.url + "/api/v1/probe", data=body, timeout=120,
                                 headers={"Authorization": f"Bearer {token}"}).status_code
        except requests.RequestException:
            return 0

    with ThreadPoolExecutor(concurrent) as pool:
        statuses = list(pool.map(probe, range(concurrent * rounds)))
    return {"probes": len(statuses), "concurrent": concurrent, "ok": statuses.count(200),
            "status_5xx": sum(s >= 500 for s in statuses), "no_answer": statuses.count(0)} | peak.growth()


def slow_probes_and_chunks(server: CoordinatorProcess, token: str, worker_id: str, connections: int,
                           normal: "NormalWorker") -> dict[str, Any]:
    """Slow probes, stalled probes and slow upload chunks held open while a normal worker pushes and pulls."""
    body = b"\0" * (3 * MiB)
    r = requests.post(server.url + f"/api/v1/experts/{EXPERT}/uploads", timeout=30,
                      headers={"Authorization": f"Bearer {token}"},
                      json={"update": update_meta(update_id=uuid.uuid4().hex, worker_id=worker_id), "size": len(body),
                            "digest": "sha256=" + hashlib.sha256(body).hexdigest()})
    assert r.status_code == 201, r.text
    host, port = server.url.split("://")[1].split(":")
    counts = {"slow_probe": connections, "stalled_probe": connections // 2, "slow_chunk": connections}
    attack = Attack(host, int(port), False, counts, "", token, chunk_path=r.headers["Location"])
    peak = Peak(server.pid, server.data_dir)
    all_opened = attack.start()
    loaded = normal.run(rounds=5)
    open_during = attack.open_now
    attack.stop()
    return {"connections": dict(attack.opened), "failed_to_open": attack.failed_to_open, "all_opened": all_opened,
            "open_while_the_worker_synced": open_during, "closed_by_server": dict(attack.closed_by_server),
            "worker_under_attack": loaded} | peak.growth()


class NormalWorker:
    """A registered worker that pushes a small update and pulls the expert, as a healthy worker's sync does."""

    def __init__(self, url: str, token: str, worker_id: str) -> None:
        self.url, self.headers, self.worker_id = url, {"Authorization": f"Bearer {token}"}, worker_id
        self.body = dumps(random_like(make_adapter(seed=3), seed=5, scale=1e-3))

    def run(self, rounds: int) -> dict[str, Any]:
        statuses, seconds = [], []
        for _ in range(rounds):
            started = time.monotonic()
            try:
                meta = update_meta(update_id=uuid.uuid4().hex, worker_id=self.worker_id)
                push = requests.post(f"{self.url}/api/v1/experts/{EXPERT}/updates", data=self.body, timeout=60,
                                     headers={**self.headers, "X-FedMoE-Update": json.dumps(meta),
                                              "X-FedMoE-Digest": "sha256=" + hashlib.sha256(self.body).hexdigest()})
                pull = requests.get(f"{self.url}/api/v1/experts/{EXPERT}/weights", headers=self.headers, timeout=60)
                statuses += [push.status_code, pull.status_code]
            except requests.RequestException:
                statuses.append(0)
            seconds.append(time.monotonic() - started)
        return {"syncs": rounds, "ok": sum(s in (200, 202) for s in statuses) == 2 * rounds,
                "statuses": sorted(set(statuses)), "slowest_sync_s": round(max(seconds), 3)}


def _register(url: str, join: str, worker_id: str, specialty: str) -> str:
    r = requests.post(f"{url}/api/v1/workers", timeout=30, headers={"Authorization": f"Bearer {join}"},
                      json={"worker_id": worker_id, "specialty": specialty,
                            "base_model": {"id": "tiny-test", "fingerprint": FINGERPRINT}})
    assert r.status_code == 200, r.text
    return r.json()["token"]


def new_surface(data_dir: Path, connections: int) -> dict[str, Any]:
    """The matrix, slow clients and probe flood against a root and a relay in front of it."""
    flags = ("--rate-limit", "0", "--socket-timeout", "10")
    root = CoordinatorProcess(data_dir / "root", *flags)
    root.start()
    relay = None
    try:
        r = requests.put(f"{root.url}/api/v1/experts/{EXPERT}", data=dumps(make_adapter(seed=3)), timeout=60,
                         headers={**root.headers, EXPERT_HEADER: json.dumps(expert_spec())})
        assert r.status_code == 201, r.text
        relay = CoordinatorProcess(data_dir / "relay", *flags, "--upstream", root.url, "--join-token-file",
                                   str(data_dir / "root" / "join_token"), "--relay-join-token-file",
                                   str(data_dir / "root" / "relay_join_token"), "--forward-interval", "1")
        relay.start()
        join = (data_dir / "root" / "join_token").read_text().strip()
        report: dict[str, Any] = {}
        for server, tag in ((root, "root"), (relay, "relay")):
            own = _register(server.url, join, f"{tag}-own", EXPERT)
            other = _register(server.url, join, f"{tag}-other", "sql_expert")
            normal = NormalWorker(relay.url, _register(relay.url, join, f"{tag}-healthy", EXPERT), f"{tag}-healthy")
            report[tag] = {"matrix": request_matrix(server, {"join": join}, own, other,
                                                    server.headers["Authorization"].split()[1]),
                           "slow_clients": slow_probes_and_chunks(server, own, f"{tag}-own", connections, normal),
                           "probe_flood": probe_flood(server, own),
                           "worker_after": normal.run(rounds=2)}
        return report
    finally:
        if relay is not None:
            relay.stop()
        root.stop()


def surface_table(surface: dict[str, Any]) -> str:
    rows = []
    for tag, part in surface.items():
        matrix, slow, flood = part["matrix"], part["slow_clients"], part["probe_flood"]
        rows.append([tag, matrix["requests"], matrix["status_5xx"], len(matrix["unexpected"]),
                     len(matrix["known_open"]), sum(slow["connections"].values()),
                     slow["worker_under_attack"]["ok"] and part["worker_after"]["ok"], slow["memory_mib"],
                     f"{flood['ok']}/{flood['probes']}", flood["memory_mib"], flood["data_dir_mib"]])
    return format_table(["new_surface", "requests", "5xx", "unexpected", "known open", "slow conns",
                         "worker syncs ok", "slow +MiB", "probes ok", "flood +MiB", "flood disk +MiB"], rows)


@attacks.attack("new_surface", table=surface_table)
def new_surface_attack(directory: Path, s: attacks.Settings) -> dict[str, Any]:
    """The routes added since the first hostile run, against a root and a relay."""
    log.info("new surface: probe, uploads, since, Range, relay API, framing; root and relay")
    return new_surface(directory, min(s.connections, 200))
