"""Hostile clients against the HTTP serving path, for bench/hostile.py: serve.py under slow clients (A/B against
another checkout's serve.py in the same run) and serve.py's sampling edge values (bench/hostile_serving.py), header
bytes and a TLS relay (here); what they share is in bench/hostile_clients.py.

Each attack is one function that starts what it needs on loopback and returns what the hostile benchmark reports for
every class: requests sent, 5xx answers, requests with no answer, and an honest client's latencies (p50/p99) during
the attack (and, for slow clients, without it first, in the same run).
"""
from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from bench.attacks import Settings, attack
from bench.common import ROOT, CoordinatorProcess, format_table
from bench.attacks import self_signed
from bench.hostile_clients import Honest, Tally, raw_status, status_of
from bench.hostile_serving import EXPERT, sampling_edges, serve_slow_clients
from bench.slow_clients import KINDS, Attack
from bench.harness import git_head

log = logging.getLogger("bench.hostile_front")
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
                               "--relay-join-token-file", str(directory / "root" / "relay_join_token"),
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
        held, closed = attack.open_now, dict(attack.closed_by_server)
    finally:
        attack.stop()
    tally.honest_s = client.seconds
    plain = [s for n, s in tally.statuses.items() if n.startswith("plain")]
    summary = tally.summary()
    # Closed by the relay while the honest client ran, by kind, as the attacker noticed (it looks every 2 s, so a
    # short honest phase can end before it does): slow_body is refused from its head (no token: a 401, then closed),
    # idle_keepalive once --keepalive passes; a header drip makes progress and is kept
    return summary | {"slow_tls_connections": sum(counts.values()), "held_during": held,
                      "closed_during": closed, "failed_to_open": attack.failed_to_open,
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
            self.client.updates.push(EXPERT, self.body, meta)
        except FedMoEError as exc:
            return exc.status
        return 202


def _relay_worker(url: str, directory: Path, cert: Path) -> _RelayWorker:
    import torch

    from protocol.client import CoordinatorClient, RetryPolicy
    from protocol.tensors import dumps

    client = CoordinatorClient(url, ca_cert=cert, token=(directory / "join").read_text().strip(),
                               retry=RetryPolicy(attempts=1), timeout=(30.0, 120.0))
    client.workers.register("w-honest", EXPERT, {"id": "bench", "fingerprint": "be" * 32})
    g = torch.Generator().manual_seed(0)
    adapter = {f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_{ab}.weight":
               torch.randn(shape, generator=g) for layer in range(2) for ab, shape in (("A", (4, 64)), ("B", (64, 4)))}
    client.experts.create(EXPERT, adapter, {"lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj"]},
                                           "base_model": {"id": "bench", "fingerprint": "be" * 32}})
    return _RelayWorker(client, dumps({k: v * 1e-3 for k, v in adapter.items()}))


# the attack classes (bench/attacks.py's registry) ------------------------------------------------------------------

def _stamped(part: dict[str, Any]) -> dict[str, Any]:
    """Which code ran, on how busy a machine (a class of this module can run alone, e.g. in bench.front_ab)."""
    return part | {"stamp": {"commit": git_head(ROOT), "load_average": [round(x, 2) for x in os.getloadavg()]}}


def _serve_table(part: dict[str, Any]) -> str:
    rows = []
    for side in part["sides"].values():
        quiet, loaded = side["quiet"], side["under_attack"]
        rows.append([f"serve.py slow clients, {side['server']} ({side['connections']} conns)", loaded["requests"],
                     loaded["status_5xx"], loaded["no_answer"], side["peak_rss_growth_mb"],
                     f"{quiet['health']['p99_s']} -> {loaded['health']['p99_s']}",
                     f"{quiet['completion']['p99_s']} -> {loaded['completion']['p99_s']}"])
    return format_table(["attack", "requests", "5xx", "no answer", "peak RSS +MiB", "honest health p99 s",
                         "honest completion p99 s"], rows)


def _honest_row(name: str) -> Callable[[dict[str, Any]], list[list[Any]]]:
    """A row of bench.hostile's common table: the honest client's p99 (a /health GET, or serve.py's) in its
    health column."""
    def rows(part: dict[str, Any]) -> list[list[Any]]:
        return [[name, part["requests"], part["status_5xx"], part["no_answer"], "", part["honest"]["p99_s"], ""]]
    return rows


def _whole(part: dict[str, Any]) -> list[dict[str, Any]]:
    return [part]


def _serve_sides(part: dict[str, Any]) -> list[dict[str, Any]]:
    return [side["under_attack"] for side in part["sides"].values()]


@attack("serve_slow_clients", table=_serve_table, tallies=_serve_sides)
def serve_slow_clients_attack(directory: Path, s: Settings) -> dict[str, Any]:
    """serve.py under --connections slow connections; with --serve-baseline another checkout's serve.py too."""
    roots = [ROOT] + ([s.serve_baseline.resolve()] if s.serve_baseline else [])
    log.info("serve.py under %d slow connections (%s)", s.connections, ", ".join(map(str, roots)))
    return _stamped({"sides": serve_slow_clients(directory, roots, s.connections, s.health, s.pushes)})


@attack("serve_sampling", rows=_honest_row("serve_sampling"), tallies=_whole)
def serve_sampling_attack(directory: Path, s: Settings) -> dict[str, Any]:
    log.info("serve.py: sampling edge values")
    return _stamped(sampling_edges(directory))


@attack("header_bytes", rows=_honest_row("header_bytes"), tallies=_whole)
def header_bytes_attack(directory: Path, s: Settings) -> dict[str, Any]:
    log.info("header bytes: CR, LF, NUL and friends in request heads")
    return _stamped(header_bytes(directory))


@attack("tls_relay", rows=_honest_row("tls_relay"), tallies=_whole)
def tls_relay_attack(directory: Path, s: Settings) -> dict[str, Any]:
    log.info("a TLS relay: plain HTTP refused, https answered, %d slow TLS clients", s.connections)
    return _stamped(tls_relay(directory, s.connections))
