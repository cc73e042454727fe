"""Hostile clients against the HTTP serving path, for bench/hostile.py: serve.py under slow clients (A/B against
another checkout's serve.py in the same run), serve.py's sampling edge values, header bytes, and a TLS relay.

Each attack is one function that starts what it needs on loopback and returns what the hostile benchmark reports for
every class: requests sent, 5xx answers, requests with no answer, and an honest client's latencies (p50/p99) during
the attack (and, for slow clients, without it first, in the same run).
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from bench.common import ROOT, CoordinatorProcess, format_table
from bench.slow_clients import KINDS, Attack

log = logging.getLogger("bench.hostile_front")
SERVING = re.compile(r"serving listening on (http://[\d.]+:\d+)")
KEY = "sk-bench-hostile"
EXPERT = "python_expert"
MAX_TOKENS = 4
SAMPLING_EDGES: dict[str, dict[str, Any]] = {
    "temperature 1e-300": {"temperature": 1e-300}, "temperature 5e-324": {"temperature": 5e-324},
    "temperature 1e-45": {"temperature": 1e-45}, "temperature 1e-38": {"temperature": 1e-38},
    "temperature 1e-5": {"temperature": 1e-5}, "temperature 2": {"temperature": 2.0},
    "top_p 5e-324": {"temperature": 1.0, "top_p": 5e-324}, "top_p 1e-300 at 1e-45": {"temperature": 1e-45,
                                                                                        "top_p": 1e-300},
    "top_p 1": {"temperature": 1.0, "top_p": 1.0}, "temperature 2, top_p 1e-5": {"temperature": 2.0, "top_p": 1e-5},
    # refused (400): out of range, not numbers
    "temperature -5e-324": {"temperature": -5e-324}, "temperature 2.0000000000000004": {"temperature": 2 + 4e-16},
    "temperature 1e309 (inf)": {"temperature": 1e309}, "temperature true": {"temperature": True},
    "top_p 0": {"top_p": 0}, "top_p -0.0": {"top_p": -0.0}, "top_p 1.0000000000000002": {"top_p": 1 + 2e-16},
}
"""Sampling values at the edges of what serve.py takes: all answered 200 or 400, never a 5xx."""
HEADER_BYTES: dict[str, bytes] = {
    "bare LF in a value": b"X-A: one\nTransfer-Encoding: chunked",
    "bare LF, then a header": b"X-A: one\nX-B: two",
    "bare CR in a value": b"X-A: one\rtwo",
    "NUL in a value": b"X-A: one\x00two",
    "NUL in a name": b"X-\x00A: one",
    "DEL in a value": b"X-A: one\x7ftwo",
    "obs-fold": b"X-A: one\r\n two",
    "high bytes in a value": "X-A: caf\u00e9 \u00ff".encode("latin-1"),
    "tab in a value": b"X-A: one\ttwo",
}
"""Request heads with unusual bytes in a header: the first five and obs-fold are refused (400), the rest are legal."""
PARTS = ("serve_slow_clients", "serve_sampling", "header_bytes", "tls_relay")
"""This module's attack classes, as bench/hostile.py's --only names them."""


# results ------------------------------------------------------------------------------------------------

def percentiles(seconds: Sequence[float]) -> dict[str, float | None]:
    if not seconds:
        return {"p50_s": None, "p99_s": None}
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"p50_s": round(statistics.median(ordered), 4), "p99_s": round(p99, 4)}


@dataclass
class Tally:
    """Answers in one attack: statuses by case, failures to get any answer, an honest client's latencies."""

    statuses: dict[str, int | None] = field(default_factory=dict)
    honest_s: list[float] = field(default_factory=list)

    def record(self, name: str, status: int | None) -> None:
        self.statuses[name] = status

    def summary(self) -> dict[str, Any]:
        got = [s for s in self.statuses.values() if s is not None]
        return {"requests": len(self.statuses), "status_5xx": sum(s >= 500 for s in got),
                "no_answer": len(self.statuses) - len(got), "honest": percentiles(self.honest_s),
                "statuses": self.statuses}


def rss_bytes(pid: int, name: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {name} for process {pid}")


def peak_growth(pid: int, attack: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``attack``; (its result, the process's peak RSS growth in bytes meanwhile)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := current RSS
    before = rss_bytes(pid)
    result = attack()
    return result, max(0, rss_bytes(pid, "VmHWM") - before)


# serve.py -----------------------------------------------------------------------------------------------

class ServeProcess:
    """serve.py of checkout ``root`` as users start it, on a free loopback port, in front of ``coordinator``."""

    def __init__(self, root: Path, coordinator: str, keys: Path, *flags: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen([sys.executable, str(root / "serve.py"), "--coordinator-url", coordinator,
                                      "--port", "0", "--api-key-file", str(keys), "--threads", "1", *flags],
                                     cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None  # stdout=PIPE
        self.log: list[str] = []
        for line in self.proc.stdout:
            self.log.append(line)
            if m := SERVING.search(line):
                self.url = m.group(1)
                break
        else:
            raise RuntimeError("serve.py exited before listening:\n" + "".join(self.log[-30:]))
        threading.Thread(target=self.log.extend, args=(self.proc.stdout,), daemon=True).start()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def seeded_coordinator(directory: Path) -> CoordinatorProcess:
    """A coordinator holding one tiny-qwen2 LoRA expert, EXPERT, for serve.py to load."""
    from bench.serve import lora_adapter
    from protocol.client import CoordinatorClient
    from worker.models import LORA_PROJECTIONS, load_base_model

    coordinator = CoordinatorProcess(directory, "--rate-limit", "0")
    coordinator.start()
    base = load_base_model("tiny-qwen2")
    spec = {"lora": {"rank": 8, "alpha": 16.0, "target_modules": list(LORA_PROJECTIONS)},
            "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
    CoordinatorClient(coordinator.url).create_expert(EXPERT, lora_adapter(base.model, 0), spec)
    return coordinator


def start_serve(root: Path, coordinator: CoordinatorProcess, directory: Path) -> ServeProcess:
    keys = directory / f"keys-{os.getpid()}-{time.monotonic_ns()}.txt"
    keys.write_text(KEY + "\n")
    return ServeProcess(root, coordinator.url, keys, "--max-tokens", "64", "--timeout", "120")


def chat(url: str, timeout: float = 120.0, **sampling: Any) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=timeout,
                         data=json.dumps({"model": EXPERT, "messages": [{"role": "user", "content": "def add(a, b):"}],
                                          "max_tokens": MAX_TOKENS, **sampling}),
                         )


class HonestServeClient:
    """GET /health and short greedy completions, one new connection each, latencies kept."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url, self.timeout = url, timeout

    def run(self, health: int, completions: int) -> dict[str, Any]:
        tally, health_s, chat_s = Tally(), [], []
        for i in range(max(health, completions)):
            if i < health:
                health_s += self._timed(tally, f"health {i}", lambda: requests.get(self.url + "/health",
                                                                                    timeout=self.timeout))
            if i < completions:
                chat_s += self._timed(tally, f"completion {i}", lambda: chat(self.url, self.timeout, temperature=0))
        return tally.summary() | {"health": percentiles(health_s), "completion": percentiles(chat_s),
                                  "health_answered": len(health_s), "completions_answered": len(chat_s)}

    @staticmethod
    def _timed(tally: Tally, name: str, call: Callable[[], requests.Response]) -> list[float]:
        started = time.perf_counter()
        try:
            status: int | None = call().status_code
        except requests.RequestException:
            status = None
        tally.record(name, status)
        return [time.perf_counter() - started] if status is not None and status < 500 else []


def serve_slow_clients(directory: Path, roots: Sequence[Path], connections: int, health: int, completions: int,
                       timeout: float = 120.0) -> dict[str, Any]:
    """serve.py of each checkout in ``roots`` in turn, against one coordinator: an honest client's latencies without,
    then with, ``connections`` slow clients (dripped heads, slow bodies, idle keep-alive; no key needed) holding
    sockets, and serve.py's peak RSS growth meanwhile."""
    directory.mkdir(parents=True, exist_ok=True)
    coordinator = seeded_coordinator(directory / "coordinator")
    try:
        return {str(root): _serve_under_attack(root, coordinator, directory, connections, health, completions,
                                               timeout) for root in roots}
    finally:
        coordinator.stop()


def _serve_under_attack(root: Path, coordinator: CoordinatorProcess, directory: Path, connections: int, health: int,
                        completions: int, timeout: float) -> dict[str, Any]:
    server = start_serve(root, coordinator, directory)
    try:
        client = HonestServeClient(server.url, timeout)
        client.run(2, 2)  # warm: the first generation's one-time costs are not what this compares
        quiet = client.run(health, completions)
        host, port = server.url.split("://")[1].split(":")
        counts = {kind: connections // 3 + (i < connections % 3) for i, kind in enumerate(KINDS[:3])}
        attack = Attack(host, int(port), False, counts, "/v1/models", KEY, health_path="/health",
                        body_path="/v1/chat/completions", body_size=500_000)

        def under_attack() -> dict[str, Any]:
            all_opened = attack.start()
            loaded = client.run(health, completions)
            still_open = attack.open_now
            attack.stop()
            return loaded | {"all_opened": all_opened, "open_during": still_open}

        loaded, growth = peak_growth(server.proc.pid, under_attack)
    finally:
        server.stop()
    log.info("serve.py of %s: quiet %s, under attack %s", root, quiet["completion"], loaded["completion"])
    return {"server": _server_kind(root), "connections": connections, "opened": dict(attack.opened),
            "failed_to_open": attack.failed_to_open, "closed_by_server_before_end": dict(attack.closed_by_server),
            "quiet": quiet, "under_attack": loaded, "peak_rss_growth_mb": round(growth / (1 << 20), 1)}


def _server_kind(root: Path) -> str:
    text = (root / "serving" / "server.py").read_text()
    return "buffering front" if "serve_http" in text else "werkzeug threaded" if "make_server" in text else "?"


class Honest:
    """An honest client's calls (each returns the answer's status) in a loop on a thread of its own while an attack
    runs: the latencies of those answered below 500, and how many were not."""

    def __init__(self, calls: Sequence[Callable[[], int]]) -> None:
        self.calls = calls
        self.seconds: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="honest-client", daemon=True)

    def __enter__(self) -> Honest:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(300)

    def _run(self) -> None:
        while not self._stop.is_set():
            for call in self.calls:
                started = time.perf_counter()
                try:
                    ok = call() < 500
                except (requests.RequestException, OSError):
                    ok = False
                if ok:
                    self.seconds.append(time.perf_counter() - started)
                else:
                    self.failed += 1


def status_of(call: Callable[[], requests.Response]) -> Callable[[], int]:
    return lambda: call().status_code


def sampling_edges(directory: Path, rounds: int = 1) -> dict[str, Any]:
    """SAMPLING_EDGES sent to this checkout's serve.py (``rounds`` times each), an honest client asking meanwhile."""
    directory.mkdir(parents=True, exist_ok=True)
    coordinator = seeded_coordinator(directory / "coordinator")
    try:
        server = start_serve(ROOT, coordinator, directory)
        try:
            tally = Tally()
            honest = [status_of(lambda: requests.get(server.url + "/health", timeout=120)),
                      status_of(lambda: chat(server.url, temperature=0))]
            with Honest(honest) as client:
                for i in range(rounds):
                    for name, sampling in SAMPLING_EDGES.items():
                        try:
                            tally.record(f"{name} #{i + 1}", chat(server.url, **sampling).status_code)
                        except requests.RequestException:
                            tally.record(f"{name} #{i + 1}", None)
            tally.honest_s = client.seconds
        finally:
            server.stop()
    finally:
        coordinator.stop()
    return tally.summary() | {"honest_failed": client.failed}


def raw_status(host: str, port: int, head: bytes, context: ssl.SSLContext | None = None) -> int | None:
    """Send ``head`` on a new connection; the answer's status (None: closed without one)."""
    try:
        with socket.create_connection((host, port), timeout=30) as raw:
            sock = context.wrap_socket(raw, server_hostname=host) if context else raw
            sock.sendall(head)
            answer = b""
            while b"\r\n" not in answer and (piece := sock.recv(4096)):
                answer += piece
    except (OSError, ssl.SSLError):
        return None
    first = answer.split(b"\r\n", 1)[0].split()
    return int(first[1]) if len(first) > 1 and first[0].startswith(b"HTTP/") else None


def header_bytes(directory: Path, rounds: int = 3) -> dict[str, Any]:
    """HEADER_BYTES in a GET of /api/v1/health at a root coordinator, an honest client asking meanwhile."""
    coordinator = CoordinatorProcess(directory, "--rate-limit", "0")
    coordinator.start()
    try:
        host, port = coordinator.url.split("://")[1].split(":")
        tally = Tally()
        with Honest([status_of(lambda: requests.get(coordinator.url + "/api/v1/health", timeout=60))]) as client:
            for i in range(rounds):
                for name, line in HEADER_BYTES.items():
                    head = b"GET /api/v1/health HTTP/1.1\r\nHost: b\r\n" + line + b"\r\n\r\n"
                    tally.record(f"{name} #{i + 1}", raw_status(host, int(port), head))
        tally.honest_s = client.seconds
    finally:
        coordinator.stop()
    refused = {name for name in HEADER_BYTES if name not in ("DEL in a value", "high bytes in a value",
                                                              "tab in a value")}
    wrong = sorted(n for n, s in tally.statuses.items() if s != (400 if n.rsplit(" #", 1)[0] in refused else 200))
    return tally.summary() | {"unexpected": wrong, "honest_failed": client.failed}


def tls_relay(directory: Path, connections: int, rounds: int = 20) -> dict[str, Any]:
    """A relay started with --tls-cert/--tls-key (issue 30, 3): plain HTTP sent to it gets no HTTP answer, https is
    answered, and ``connections`` slow TLS clients (dripped heads, slow bodies, idle) are held while an honest worker
    reads /health and pushes small updates through it over https."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = self_signed(directory)
    root = CoordinatorProcess(directory / "root", "--rate-limit", "0")
    root.start()
    relay = CoordinatorProcess(directory / "relay", "--upstream", root.url, "--join-token-file", str(directory / "join"),
                               "--forward-interval", "3600", "--rate-limit", "0", "--tls-cert", str(cert),
                               "--tls-key", str(key))
    try:
        (directory / "join").write_text((directory / "root" / "join_token").read_text())
        relay.start()
        return {"relay_scheme": relay.url.split("://")[0]} | _attack_tls_relay(relay, directory, cert, connections,
                                                                               rounds)
    finally:
        relay.stop()
        root.stop()


def _attack_tls_relay(relay: CoordinatorProcess, directory: Path, cert: Path, connections: int,
                      rounds: int) -> dict[str, Any]:
    worker = _relay_worker(relay.url, directory, cert)
    host, port = relay.url.split("://")[1].split(":")
    context = ssl.create_default_context(cafile=str(cert))
    tally = Tally()
    counts = {kind: connections // 3 + (i < connections % 3) for i, kind in enumerate(KINDS[:3])}
    attack = Attack(host, int(port), True, counts, f"/api/v1/experts/{EXPERT}/weights",
                    relay.headers["Authorization"].split()[1])
    attack.start()
    try:
        with Honest([status_of(lambda: requests.get(relay.url + "/api/v1/health", timeout=120, verify=str(cert))),
                     worker.push]) as client:
            for i in range(rounds):  # plain HTTP to the TLS port: no HTTP answer (the client's "speaks TLS" probe)
                tally.record(f"plain http #{i + 1}", raw_status(host, int(port), b"GET /api/v1/health HTTP/1.1\r\n"
                                                                                   b"Host: b\r\n\r\n"))
                tally.record(f"https #{i + 1}", raw_status(host, int(port), b"GET /api/v1/health HTTP/1.1\r\n"
                                                                             b"Host: b\r\n\r\n", context))
        held = attack.open_now
    finally:
        attack.stop()
    tally.honest_s = client.seconds
    plain = [s for n, s in tally.statuses.items() if n.startswith("plain")]
    summary = tally.summary()
    return summary | {"slow_tls_connections": sum(counts.values()), "held_during": held,
                      "plain_http_answered": sum(s is not None for s in plain),
                      "https_ok": sum(s == 200 for n, s in tally.statuses.items() if n.startswith("https")),
                      "no_answer": summary["no_answer"] - len(plain),  # plain HTTP is meant to get none
                      "honest_failed": client.failed, "honest_pushes": worker.pushed}


@dataclass
class _RelayWorker:
    """A worker registered at the relay over https, pushing small updates of one tiny expert."""

    client: Any
    """protocol.client.CoordinatorClient"""
    body: bytes
    pushed: int = 0

    def push(self) -> int:
        """One push (no retries: the client is built with one attempt); its status."""
        from protocol.errors import FedMoEError

        self.pushed += 1
        meta = {"update_id": f"honest-{self.pushed}-{time.monotonic_ns()}", "base_version": 0, "num_samples": 1,
                "worker_id": "w-honest"}
        try:
            self.client.push_update(EXPERT, self.body, meta)
        except FedMoEError as exc:
            return exc.status
        return 202


def _relay_worker(url: str, directory: Path, cert: Path) -> _RelayWorker:
    import torch

    from protocol.client import CoordinatorClient, RetryPolicy
    from protocol.tensors import dumps

    client = CoordinatorClient(url, ca_cert=cert, token=(directory / "join").read_text().strip(),
                               retry=RetryPolicy(attempts=1), timeout=(30.0, 120.0))
    client.register_worker("w-honest", EXPERT, {"id": "bench", "fingerprint": "be" * 32})
    g = torch.Generator().manual_seed(0)
    adapter = {f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_{ab}.weight":
               torch.randn(shape, generator=g) for layer in range(2) for ab, shape in (("A", (4, 64)), ("B", (64, 4)))}
    client.create_expert(EXPERT, adapter, {"lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj"]},
                                           "base_model": {"id": "bench", "fingerprint": "be" * 32}})
    return _RelayWorker(client, dumps({k: v * 1e-3 for k, v in adapter.items()}))


def self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out",
                    str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


# bench/hostile.py's entry points --------------------------------------------------------------------------

def run_parts(scratch: Path, only: Sequence[str], connections: int, health: int, completions: int,
              serve_baseline: Path | None) -> dict[str, Any]:
    """The classes of this module that ``only`` names, each in a directory of its own under ``scratch``."""
    report: dict[str, Any] = {}
    if "serve_slow_clients" in only:
        roots = [ROOT] + ([serve_baseline.resolve()] if serve_baseline else [])
        log.info("serve.py under %d slow connections (%s)", connections, ", ".join(map(str, roots)))
        report["serve_slow_clients"] = serve_slow_clients(scratch / "serve-slow", roots, connections, health,
                                                          completions)
    if "serve_sampling" in only:
        log.info("serve.py: sampling edge values")
        report["serve_sampling"] = sampling_edges(scratch / "serve-sampling")
    if "header_bytes" in only:
        log.info("header bytes: CR, LF, NUL and friends in request heads")
        report["header_bytes"] = header_bytes(scratch / "header-bytes")
    if "tls_relay" in only:
        log.info("a TLS relay: plain HTTP refused, https answered, %d slow TLS clients", connections)
        report["tls_relay"] = tls_relay(scratch / "tls-relay", connections)
    return report


def summaries(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each class's summary (requests, status_5xx), for the benchmark's totals."""
    parts = [report[name] for name in ("serve_sampling", "header_bytes", "tls_relay") if name in report]
    parts += [side["under_attack"] for side in report.get("serve_slow_clients", {}).values()]
    return parts


def table(report: dict[str, Any]) -> str:
    rows = []
    for root, side in report.get("serve_slow_clients", {}).items():
        quiet, loaded = side["quiet"], side["under_attack"]
        rows.append([f"serve.py slow clients, {side['server']} ({side['connections']} conns)", loaded["requests"],
                     loaded["status_5xx"], loaded["no_answer"], side["peak_rss_growth_mb"],
                     f"{quiet['health']['p99_s']} -> {loaded['health']['p99_s']}",
                     f"{quiet['completion']['p99_s']} -> {loaded['completion']['p99_s']}"])
    for name in ("serve_sampling", "header_bytes", "tls_relay"):
        if name in report:
            part = report[name]
            rows.append([name, part["requests"], part["status_5xx"], part["no_answer"], "",
                         part["honest"]["p99_s"], ""])
    if not rows:
        return ""
    return format_table(["attack", "requests", "5xx", "no answer", "peak RSS +MiB", "honest health p99 s",
                         "honest completion p99 s"], rows)
