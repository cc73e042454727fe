#!/usr/bin/env python3
"""Hostile-client benchmark: bad inputs, overflow, nesting, huge prompts, slow clients, big compressed pushes.

Every attack runs against a real run_coordinator.py on loopback (bench.common.CoordinatorProcess),
bounded in count and time. Reported per attack: requests tried, 5xx answers (target 0: a 5xx is a
bug), the coordinator's peak RSS growth (VmHWM reset before each attack), and, for slow clients,
a normal client's /health and 5 MB push latencies (p50/p99) while 1,000 slow or idle connections
are open, plain and TLS, against the same client's figures with no attack (same run).

- ``bad_inputs``: tests/e2e/test_bad_inputs.py's matrix (--max-body-mb 1, --norm-check reject).
- ``hostile``: pushes of 3e38 (finite, the sum is not), 3,000-level nested JSON on every JSON
  route, query and X-FedMoE-* header, and one huge /route prompt.
- ``slow_clients``: bench/slow_clients.py's kinds: ``--connections`` split between dripped heads,
  slow bodies and idle keep-alive (no token needed), plus ``--slow-readers`` that never read a pull.
- ``compressed_pushes``: 8 concurrent maximum-size fp16 pushes to an expert of ``--model-mb``;
  target: peak RSS growth <= 2x the model size + 64 MiB (issue 13, defect 6).
- ``serve_slow_clients``, ``serve_sampling``, ``header_bytes``, ``tls_relay`` (bench/hostile_front.py): serve.py
  under slow clients (``--serve-baseline``: another checkout's serve.py too, A/B), its sampling edge values, CR/LF/NUL
  in request heads, and a relay started with --tls-cert; an honest client's p99 during each.
- ``backend_faults`` (only when named: it starts PostgreSQL and moto's S3 server): replicas started on a mistyped
  or empty store, the bucket lost while running, a table lock, with an honest worker pushing (bench/hostile_backends.py).
- ``new_surface``: the routes added since (upload probe, resumable uploads, ``?since=``, Range, the relay's
  API) and HTTP framing lies, against a root and a relay; slow probes and upload chunks while a normal worker
  syncs through the relay; 64 concurrent 4 MiB probes (bench/hostile_surface.py).
- ``reservation_exhaustion``: resumable uploads opened by every identity the workers' join token gives and never
  sent, declaring 1.25x the free disk; then an honest worker's 9 MiB pushes (bench/hostile_reservations.py).
- ``relay_poisoning``: a worker pushing finite deltas of 3e38 behind a real relay, plain and ``--site-model``;
  honest acknowledged updates lost or doubled at the root, pulls holding Inf (bench/hostile_relay.py).

    python -m bench.hostile            # 1,000 slow connections, 240 MiB model; a few minutes
    python -m bench.hostile --quick    # 100 connections, 16 MiB model (tests/bench)

Table on stdout, progress on stderr, results in bench/results/hostile.json.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import requests
import torch
import urllib3

import bench.common
import bench.hostile_front
from bench.common import RESULTS_DIR, SCRATCH_DIR, CoordinatorProcess, configure_logging, format_table, write_json_atomic
from bench.slow_clients import KINDS, Attack
from compression.registry import make_codec
from compression.wire import encode_update
from gateway.router import profile_to_json, text_profile
from protocol.schemas import EXPERT_HEADER, UPDATE_HEADER, WORKER_HEADER
from protocol.tensors import dumps, manifest_of
from tests.helpers import expert_spec, make_adapter, update_meta

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench.hostile")
MiB = 1 << 20
P99_TARGET_S = 1.0
PARTS = ("bad_inputs", "hostile", "slow_clients", "compressed_pushes", "new_surface", "reservation_exhaustion",
         "relay_poisoning", *bench.hostile_front.PARTS, "backend_faults")
DEFAULT_PARTS = PARTS[:-1]  # backend_faults starts PostgreSQL and moto's S3 server: asked for by name
NESTING = 3000
urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)  # our own self-signed loopback cert


@dataclass
class Tally:
    """Every answer the bench got in one attack."""

    statuses: list[int] = field(default_factory=list)
    failures: int = 0
    """Requests that got no HTTP answer at all (refused, reset, timed out)."""
    cases: dict[str, Any] = field(default_factory=dict)

    def send(self, name: str, call: Callable[[], Any], expected: int | None = None) -> int | None:
        try:
            answer = call()
        except requests.RequestException as exc:
            self.failures += 1
            self.cases[name] = {"status": None, "error": type(exc).__name__}
            return None
        status, body = (answer.status_code, answer.content) if isinstance(answer, requests.Response) else answer
        self.statuses.append(status)
        self.cases[name] = {"status": status, "json_error": is_json_error(body) if status >= 400 else None}
        if expected is not None:
            self.cases[name]["expected"] = expected
        return status

    def summary(self) -> dict[str, Any]:
        return {"requests": len(self.statuses) + self.failures, "status_5xx": sum(s >= 500 for s in self.statuses),
                "no_answer": self.failures,
                "unexpected": sorted(n for n, c in self.cases.items()
                                     if c["status"] is None or c["status"] >= 500
                                     or ("expected" in c and c["status"] != c["expected"]))}


def is_json_error(body: bytes) -> bool:
    try:
        error = json.loads(body)["error"]
        return isinstance(error["code"], str) and bool(error["message"])
    except (ValueError, KeyError, TypeError):
        return False


# memory of the coordinator -------------------------------------------------------

def rss_bytes(pid: int, field_name: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field_name} for process {pid}")


def serving_pid(pid: int) -> int:
    """The process that serves: ``pid`` itself, or its forked worker (gunicorn, with --server-root)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(children[0]) if children else pid


def measured(pid: int, attack: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``attack``; (its result, the coordinator's peak RSS growth in bytes during it)."""
    pid = serving_pid(pid)
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := current RSS
    before = rss_bytes(pid)
    result = attack()
    return result, max(0, rss_bytes(pid, "VmHWM") - before)


# the bad-input matrix ----------------------------------------------------------

def bad_input_matrix(data_dir: Path) -> dict[str, Any]:
    """tests/e2e/test_bad_inputs.py's cases, each sent once, against the flags that module uses."""
    from tests.e2e import test_bad_inputs as matrix

    server = CoordinatorProcess(data_dir, "--max-body-mb", "1", "--norm-check", "reject", "--norm-warmup", "1",
                                "--norm-factor", "10")
    server.start()
    try:
        target = matrix.Server(None, server.url, (data_dir / "join_token").read_text().strip())
        for name, adapter in (("e", matrix.ADAPTER), ("other", matrix.ADAPTER)):
            assert target.put_expert(name, dumps(adapter), expert_spec()).status_code == 201
        assert target.push(matrix.FIRST_BODY, matrix.REPLAYED).status_code == 202
        tally = Tally()
        _, growth = measured(server.pid, lambda: [tally.send(name, partial(send, target), status)
                                                  for name, send, status in matrix.CASES])
    finally:
        server.stop()
    return tally.summary() | {"peak_rss_growth_mb": round(growth / MiB, 1), "cases": tally.cases}


# overflow, nesting, huge prompts -------------------------------------------------

def nested(depth: int = NESTING) -> str:
    return "[" * depth + "]" * depth


def nested_object(depth: int = NESTING) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def hostile_requests(server: CoordinatorProcess, prompt_mb: float) -> dict[str, Any]:
    """Overflow pushes, deep JSON everywhere JSON is read, and a huge /route prompt; each attack measured."""
    url, auth = server.url + "/api/v1", server.headers
    adapter = make_adapter(rank=2)
    spec = expert_spec()
    put = requests.put(f"{url}/experts/overflow", data=dumps(adapter), timeout=60,
                       headers={**auth, EXPERT_HEADER: json.dumps(spec)})
    assert put.status_code in (200, 201), put.text
    profile = profile_to_json(text_profile(["def add(a, b):\n    return a + b\n"]), 10)
    requests.put(f"{url}/experts/overflow/profiles/w-bench", json=profile, headers=auth, timeout=60)
    results: dict[str, Any] = {}

    def push(meta: dict, body: bytes) -> requests.Response:
        return requests.post(f"{url}/experts/overflow/updates", data=body, timeout=120,
                             headers={**auth, UPDATE_HEADER: json.dumps(meta)})

    def overflow(tally: Tally) -> None:
        huge = dumps({k: torch.full_like(v, 3e38) for k, v in adapter.items()})
        for i in range(2):  # each finite; their sum is not
            tally.send(f"push 3e38 #{i + 1}", lambda: push(update_meta(base_version=i), huge))
        tally.send("full pull after overflow", lambda: requests.get(f"{url}/experts/overflow/weights",
                                                                    headers=auth, timeout=60))
        tally.send("diff pull after overflow", lambda: requests.get(
            f"{url}/experts/overflow/weights", params={"since": "0", "codec": "fp16"}, headers=auth, timeout=60))
        tally.send("gateway after overflow", lambda: requests.get(f"{url}/gateway", headers=auth, timeout=60))
        tally.send("gateway weights after overflow", lambda: requests.get(f"{url}/gateway/weights",
                                                                          headers=auth, timeout=60))
        tally.send("expert info after overflow", lambda: requests.get(f"{url}/experts/overflow",
                                                                      headers=auth, timeout=60))

    def nesting(tally: Tally) -> None:
        deep_body = {"data": nested(), "headers": {**auth, "Content-Type": "application/json"}, "timeout": 60}
        for route, method in (("/workers", "post"), ("/experts/overflow/profiles/w-deep", "put"), ("/route", "post")):
            for shape, text in (("list", nested()), ("object", nested_object())):
                tally.send(f"{method.upper()} {route} nested {shape}",
                           lambda: getattr(requests, method)(url + route, **(deep_body | {"data": text})))
        for shape, text in (("list", nested()), ("object", nested_object())):
            tally.send(f"{UPDATE_HEADER} nested {shape}", lambda: requests.post(
                f"{url}/experts/overflow/updates", data=dumps(adapter), timeout=60,
                headers={**auth, UPDATE_HEADER: text}))
            tally.send(f"{EXPERT_HEADER} nested {shape}", lambda: requests.put(
                f"{url}/experts/deep", data=dumps(adapter), timeout=60, headers={**auth, EXPERT_HEADER: text}))
            tally.send(f"codec_config nested {shape}", lambda: requests.get(
                f"{url}/experts/overflow/weights", params={"since": "0", "codec": "fp16", "codec_config": text},
                headers=auth, timeout=60))
            tally.send(f"{WORKER_HEADER} nested {shape}", lambda: requests.get(
                f"{url}/experts/overflow/weights", headers={**auth, WORKER_HEADER: text}, timeout=60))

    def huge_prompt(tally: Tally) -> None:
        prompt = "def f(x):\n    return x + 1\n" * int(prompt_mb * MiB / 28)
        tally.send(f"/route prompt of {prompt_mb:g} MiB", lambda: requests.post(
            f"{url}/route", json={"prompt": prompt}, headers=auth, timeout=300))

    for name, attack in (("overflow", overflow), ("nested_json", nesting), ("huge_prompt", huge_prompt)):
        tally = Tally()
        started = time.monotonic()
        _, growth = measured(server.pid, lambda: attack(tally))
        results[name] = tally.summary() | {"peak_rss_growth_mb": round(growth / MiB, 1),
                                           "seconds": round(time.monotonic() - started, 1), "cases": tally.cases}
        log.info("%s: %s", name, {k: v for k, v in results[name].items() if k != "cases"})
    return results


# slow clients --------------------------------------------------------------------

def self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out",
                    str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


def percentiles(seconds: Sequence[float]) -> dict[str, float | None]:
    if not seconds:
        return {"p50_s": None, "p99_s": None, "max_s": None}
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"p50_s": round(statistics.median(ordered), 4), "p99_s": round(p99, 4), "max_s": round(ordered[-1], 4)}


class NormalClient:
    """A well-behaved client: GET /health and 5 MB pushes, one new connection each, latencies kept."""

    def __init__(self, server: CoordinatorProcess, expert: str, push_body: bytes, timeout: float) -> None:
        self.server, self.expert, self.push_body, self.timeout = server, expert, push_body, timeout
        self.version = 0

    def run(self, health: int, pushes: int) -> dict[str, Any]:
        tally, health_s, push_s = Tally(), [], []
        for i in range(max(health, pushes)):
            if i < health:
                health_s += self._timed(tally, f"health {i}", self._health)
            if i < pushes:
                push_s += self._timed(tally, f"push {i}", self._push)
        return tally.summary() | {"health": percentiles(health_s), "push_5mb": percentiles(push_s),
                                  "health_answered": len(health_s), "pushes_answered": len(push_s)}

    def _timed(self, tally: Tally, name: str, call: Callable[[], requests.Response]) -> list[float]:
        started = time.perf_counter()
        status = tally.send(name, call)
        return [time.perf_counter() - started] if status is not None and status < 500 else []

    def _health(self) -> requests.Response:
        return requests.get(self.server.url + "/api/v1/health", timeout=self.timeout, verify=False)

    def _push(self) -> requests.Response:
        meta = update_meta(base_version=self.version) | {"update_id": uuid.uuid4().hex}
        r = requests.post(f"{self.server.url}/api/v1/experts/{self.expert}/updates", data=self.push_body,
                          headers={**self.server.headers, UPDATE_HEADER: json.dumps(meta)},
                          timeout=self.timeout, verify=False)
        if r.status_code in (200, 202):
            self.version = r.json()["expert_version"]
        return r


def slow_clients(data_dir: Path, tls_dir: Path | None, connections: int, readers: int, health: int, pushes: int,
                 socket_timeout: float, timeout: float) -> dict[str, Any]:
    """A normal client's latencies without, then with, ``connections`` slow clients holding sockets open.

    The connections are split evenly between dripped heads, slow bodies and idle kept-alive
    connections (none needs a token); ``readers`` more fetch the expert's weights (5 MB, with a
    token) and never read the answer.
    """
    flags = ["--socket-timeout", str(socket_timeout), "--rate-limit", "0"]
    if tls_dir is not None:
        cert, key = self_signed(tls_dir)
        flags += ["--tls-cert", str(cert), "--tls-key", str(key)]
    server = CoordinatorProcess(data_dir, *flags)
    server.start()
    try:
        adapter = make_adapter(rank=8, layers=10, d_in=4096, d_out=4096)  # ~5.2 MB as safetensors
        r = requests.put(f"{server.url}/api/v1/experts/e", data=dumps(adapter), timeout=120, verify=False,
                         headers={**server.headers, EXPERT_HEADER: json.dumps(expert_spec(rank=8))})
        assert r.status_code in (200, 201), r.text
        body = dumps({k: v * 1e-3 for k, v in adapter.items()})
        client = NormalClient(server, "e", body, timeout=timeout)
        quiet = client.run(health, pushes)
        host, port = server.url.split("://")[1].split(":")
        counts = {kind: connections // 3 + (i < connections % 3) for i, kind in enumerate(KINDS[:3])}
        attack = Attack(host, int(port), tls_dir is not None, counts | {"slow_reader": readers},
                        "/api/v1/experts/e/weights", server.headers["Authorization"].split()[1])

        def under_attack() -> dict[str, Any]:
            started = time.monotonic()
            all_opened = attack.start()
            opened_s = time.monotonic() - started
            loaded = client.run(health, pushes)
            still_open = attack.open_now
            attack.stop()
            return loaded | {"seconds_to_open": round(opened_s, 1), "all_opened": all_opened,
                             "open_during": still_open}

        loaded, growth = measured(server.pid, under_attack)
    finally:
        server.stop()
    return {"connections": connections, "slow_readers": readers, "opened": dict(attack.opened), "failed_to_open": attack.failed_to_open,
            "closed_by_server_before_end": dict(attack.closed_by_server), "quiet": quiet, "under_attack": loaded,
            "peak_rss_growth_mb": round(growth / MiB, 1), "body_bytes": len(body)}


# big compressed pushes (defect 6) ----------------------------------------------------

def compressed_pushes(data_dir: Path, model_mb: int, concurrent: int = 8) -> dict[str, Any]:
    """Peak RSS growth of the coordinator while ``concurrent`` fp16 pushes of a whole model arrive at once."""
    layers = max(1, model_mb // 4)  # 4 MiB of float32 per layer (two rank-64 modules of 4096)
    adapter = make_adapter(rank=64, layers=layers, d_in=4096, d_out=4096)
    model_bytes = 4 * sum(t.numel() for t in adapter.values())
    server = CoordinatorProcess(data_dir, "--max-body-mb", str(max(1024, 4 * model_mb)), "--rate-limit", "0")
    server.start()
    try:
        r = requests.put(f"{server.url}/api/v1/experts/big", data=dumps(adapter), timeout=600,
                         headers={**server.headers, EXPERT_HEADER: json.dumps(expert_spec(rank=64))})
        assert r.status_code in (200, 201), r.text
        payload = encode_update({k: v * 1e-3 for k, v in adapter.items()}, manifest_of(adapter), make_codec("fp16", {}))
        del adapter
        tally = Tally()

        def push(i: int) -> None:
            meta = update_meta(base_version=0, codec="fp16") | {"update_id": uuid.uuid4().hex}
            tally.send(f"fp16 push {i}", lambda: requests.post(
                f"{server.url}/api/v1/experts/big/updates", data=payload, timeout=600,
                headers={**server.headers, UPDATE_HEADER: json.dumps(meta)}))

        def burst() -> None:
            with ThreadPoolExecutor(concurrent) as pool:
                list(pool.map(push, range(concurrent)))

        idle = rss_bytes(serving_pid(server.pid))
        started = time.monotonic()
        _, growth = measured(server.pid, burst)
    finally:
        server.stop()
    limit = 2 * model_bytes + 64 * MiB
    return tally.summary() | {"model_mb": round(model_bytes / MiB, 1), "payload_mb": round(len(payload) / MiB, 1),
                              "concurrent": concurrent, "idle_rss_mb": round(idle / MiB, 1),
                              "peak_rss_growth_mb": round(growth / MiB, 1),
                              "growth_per_model_size": round(growth / model_bytes, 2),
                              "limit_mb": round(limit / MiB, 1), "within_limit": growth <= limit,
                              "seconds": round(time.monotonic() - started, 1)}


# report ---------------------------------------------------------------------------

def table(report: dict[str, Any]) -> str:
    rows = []
    for name, part in [("bad_inputs", report.get("bad_inputs")),
                       *((f"hostile.{k}", v) for k, v in report.get("hostile", {}).items()),
                       ("compressed_pushes", report.get("compressed_pushes"))]:
        if part is None:
            continue
        rows.append([name, part["requests"], part["status_5xx"], part["no_answer"], part["peak_rss_growth_mb"],
                     "", ""])
    for mode, part in report.get("slow_clients", {}).items():
        loaded = part["under_attack"]
        rows.append([f"slow_clients.{mode} ({part['connections']}+{part['slow_readers']} conns)", loaded["requests"], loaded["status_5xx"],
                     loaded["no_answer"], part["peak_rss_growth_mb"], loaded["health"]["p99_s"],
                     loaded["push_5mb"]["p99_s"]])
    text = format_table(["attack", "requests", "5xx", "no answer", "peak RSS +MiB", "health p99 s",
                         "5MB push p99 s"], rows)
    if "new_surface" in report:
        text += "\n\n" + surface_table(report["new_surface"])
    if "reservation_exhaustion" in report:
        from bench.hostile_reservations import TABLE_HEADERS, table_rows

        text += "\n\n" + format_table(TABLE_HEADERS, table_rows(report["reservation_exhaustion"]))
    if "relay_poisoning" in report:
        from bench.hostile_relay import poisoning_table

        text += "\n\n" + poisoning_table(report["relay_poisoning"])
    if "backend_faults" in report:
        from bench.hostile_backends import faults_table

        text += "\n\n" + faults_table(report["backend_faults"])
    if front := bench.hostile_front.table(report):
        text += "\n\n" + front
    return text


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    health, pushes = args.health, args.pushes
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fedmoe-hostile-", dir=SCRATCH_DIR) as scratch:
        root = Path(scratch)
        if "bad_inputs" in args.only:
            log.info("bad-input matrix")
            report["bad_inputs"] = bad_input_matrix(root / "matrix")
        if "hostile" in args.only:
            log.info("overflow, nesting, huge prompt")
            server = CoordinatorProcess(root / "hostile", "--rate-limit", "0")
            server.start()
            try:
                report["hostile"] = hostile_requests(server, args.prompt_mb)
            finally:
                server.stop()
        if "slow_clients" in args.only:
            report["slow_clients"] = {}
            for mode in ("plain", "tls"):
                log.info("slow clients (%s): %d connections", mode, args.connections)
                tls_dir = root / "tls" if mode == "tls" else None
                if tls_dir:
                    tls_dir.mkdir()
                report["slow_clients"][mode] = slow_clients(root / f"slow-{mode}", tls_dir, args.connections,
                                                            args.slow_readers, health, pushes, socket_timeout=60,
                                                            timeout=args.client_timeout)
        if "compressed_pushes" in args.only:
            log.info("%d concurrent fp16 pushes of a %d MiB model", 8, args.model_mb)
            report["compressed_pushes"] = compressed_pushes(root / "compressed", args.model_mb)
        if "new_surface" in args.only:
            from bench.hostile_surface import new_surface

            log.info("new surface: probe, uploads, since, Range, relay API, framing; root and relay")
            report["new_surface"] = new_surface(root / "surface", min(args.connections, 200))
        if "reservation_exhaustion" in args.only:
            from bench.hostile_reservations import reservation_exhaustion

            log.info("reservation exhaustion: uploads opened and never sent, then an honest worker's 9 MiB pushes")
            report["reservation_exhaustion"] = reservation_exhaustion(root / "reservations",
                                                                      honest_pushes=3 if args.quick else 10)
        if "relay_poisoning" in args.only:
            from bench.hostile_relay import relay_poisoning

            log.info("relay poisoning: 3e38 pushes behind a relay, plain and --site-model")
            report["relay_poisoning"] = relay_poisoning(root / "relay-poisoning", rounds=3 if args.quick else 6)
        if "backend_faults" in args.only:
            from bench.hostile_backends import backend_faults

            log.info("backend faults: replicas on PostgreSQL + S3; mistyped and empty store, bucket loss, table lock")
            report["backend_faults"] = backend_faults(root / "backends", lock_s=5.0 if args.quick else 15.0)
        report |= bench.hostile_front.run_parts(root, args.only, args.connections, args.health, args.pushes,
                                                args.serve_baseline)
    parts = [report.get("bad_inputs"), *report.get("hostile", {}).values(), report.get("compressed_pushes"),
             report.get("reservation_exhaustion"),
             *(p["under_attack"] for p in report.get("slow_clients", {}).values()),
             *(report.get("relay_poisoning", {}).get(mode) for mode in ("plain", "site_model"))]
    parts = [p for p in parts if p is not None] + bench.hostile_front.summaries(report)
    report |= {"requests_tried": sum(p["requests"] for p in parts), "status_5xx": sum(p["status_5xx"] for p in parts),
               "normal_client_p99_s": max(((p["under_attack"][k]["p99_s"] or float("inf"))
                                           for p in report.get("slow_clients", {}).values()
                                           for k in ("health", "push_5mb")), default=None),
               "targets": {"status_5xx": 0, "normal_client_p99_s": P99_TARGET_S,
                           "compressed_push_growth": "<= 2x model size + 64 MiB"},
               "server": args.server, "quick": args.quick, "seconds": round(time.monotonic() - started, 1)}
    write_json_atomic(args.out, report)
    return report


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--connections", type=int, default=1000, help="slow connections per transport (default: %(default)s)")
    p.add_argument("--slow-readers", type=int, default=100,
                   help="more connections that fetch 5 MB of weights and never read them (default: %(default)s)")
    p.add_argument("--model-mb", type=int, default=240, help="model size for the compressed pushes (default: %(default)s)")
    p.add_argument("--prompt-mb", type=float, default=8.0, help="size of the huge /route prompt (default: %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "hostile.json", help="results JSON")
    p.add_argument("--quick", action="store_true", help="--connections 100 --slow-readers 20 --model-mb 16 "
                                                       "--prompt-mb 1 --health 10 --pushes 3 (tests/bench)")
    p.add_argument("--only", nargs="+", choices=PARTS, default=list(DEFAULT_PARTS),
                   help="attacks to run (default: all but backend_faults, which starts PostgreSQL and moto)")
    p.add_argument("--health", type=int, default=60, help="the normal client's /health requests per phase")
    p.add_argument("--pushes", type=int, default=12, help="the normal client's 5 MB pushes per phase")
    p.add_argument("--client-timeout", type=float, default=60.0,
                   help="the normal client's timeout per request, seconds (default: %(default)s)")
    p.add_argument("--server-root", type=Path, default=None,
                   help="run another checkout's run_coordinator.py (e.g. before this change, for comparison)")
    p.add_argument("--serve-baseline", type=Path, default=None,
                   help="another checkout whose serve.py also runs the serve_slow_clients attack (A/B, same run)")
    p.add_argument("-v", "--verbose", action="store_true", help="library logs too")
    args = p.parse_args(argv)
    args.server = "buffering asyncio front (coordinator/http/front.py), 16 request threads"
    if args.server_root is not None:  # CoordinatorProcess starts ROOT/run_coordinator.py
        bench.common.ROOT = args.server_root.resolve()
        args.server = f"run_coordinator.py of {bench.common.ROOT}"
    if args.quick:
        args.connections, args.model_mb, args.prompt_mb = min(args.connections, 100), min(args.model_mb, 16), \
            min(args.prompt_mb, 1.0)
        args.health, args.pushes, args.slow_readers = min(args.health, 10), min(args.pushes, 3), \
            min(args.slow_readers, 20)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.verbose)
    report = run(args)
    print(table(report))
    print(f"requests tried {report['requests_tried']}, 5xx {report['status_5xx']} (target 0), normal client's "
          f"worst p99 under attack {report['normal_client_p99_s']} s (target < {P99_TARGET_S} s); {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
