"""The first attack classes of bench.hostile: bad inputs, overflow and deep nesting, slow clients, big compressed pushes.

- ``bad_inputs``: bench/bad_inputs.py's matrix (--max-body-mb 1, --norm-check reject).
- ``hostile``: pushes of 3e38 (finite, the sum is not), 3,000-level nested JSON on every JSON route, query and
  X-FedMoE-* header, and one huge /route prompt.
- ``slow_clients``: bench/slow_clients.py's kinds: ``--connections`` split between dripped heads, slow bodies and
  idle keep-alive (no token needed), plus ``--slow-readers`` that never read a pull; plain and TLS.
- ``compressed_pushes``: 8 concurrent maximum-size fp16 pushes to an expert of ``--model-mb``; target: peak RSS
  growth <= 2x the model size + 64 MiB (issue 13, defect 6).
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import requests
import torch

from bench import bad_inputs as matrix
from bench.attacks import MiB, Settings, Tally, attack, measured, percentiles, rss_bytes, self_signed, serving_pid
from bench.common import CoordinatorProcess
from bench.slow_clients import KINDS, Attack
from bench.updates import expert_spec, make_adapter, update_meta
from compression.registry import make_codec
from compression.wire import encode_update
from protocol.profiles import profile_to_json, text_profile
from protocol.schemas import EXPERT_HEADER, UPDATE_HEADER, WORKER_HEADER
from protocol.tensors import dumps, manifest_of

log = logging.getLogger("bench.hostile")
NESTING = 3000


def _row(name: str, part: dict[str, Any]) -> list[Any]:
    return [name, part["requests"], part["status_5xx"], part["no_answer"], part["peak_rss_growth_mb"], "", ""]


# the bad-input matrix ----------------------------------------------------------

@attack("bad_inputs", rows=lambda part: [_row("bad_inputs", part)], tallies=lambda part: [part])
def bad_input_matrix(data_dir: Path, s: Settings) -> dict[str, Any]:
    """bench/bad_inputs.py's cases (tests/e2e/test_bad_inputs.py's), each sent once, against the flags they assume."""
    server = CoordinatorProcess(data_dir, *matrix.SERVER_FLAGS)
    server.start()
    try:
        target = matrix.Server(server.url, (data_dir / "join_token").read_text().strip())
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


@attack("hostile", rows=lambda part: [_row(f"hostile.{k}", v) for k, v in part.items()],
        tallies=lambda part: list(part.values()))
def hostile(data_dir: Path, s: Settings) -> dict[str, Any]:
    """Overflow, nesting and a huge prompt against one coordinator."""
    log.info("overflow, nesting, huge prompt")
    server = CoordinatorProcess(data_dir, "--rate-limit", "0")
    server.start()
    try:
        return hostile_requests(server, s.prompt_mb)
    finally:
        server.stop()


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

    for name, send in (("overflow", overflow), ("nested_json", nesting), ("huge_prompt", huge_prompt)):
        tally = Tally()
        started = time.monotonic()
        _, growth = measured(server.pid, lambda: send(tally))
        results[name] = tally.summary() | {"peak_rss_growth_mb": round(growth / MiB, 1),
                                           "seconds": round(time.monotonic() - started, 1), "cases": tally.cases}
        log.info("%s: %s", name, {k: v for k, v in results[name].items() if k != "cases"})
    return results


# slow clients --------------------------------------------------------------------

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


@attack("slow_clients", rows=lambda part: [_slow_row(mode, p) for mode, p in part.items()],
        tallies=lambda part: [p["under_attack"] for p in part.values()])
def slow_clients_plain_and_tls(data_dir: Path, s: Settings) -> dict[str, Any]:
    """The slow clients against a plain and a TLS coordinator."""
    report = {}
    for mode in ("plain", "tls"):
        log.info("slow clients (%s): %d connections", mode, s.connections)
        tls_dir = data_dir / "certs" if mode == "tls" else None
        if tls_dir:
            tls_dir.mkdir(parents=True)
        report[mode] = slow_clients(data_dir / mode, tls_dir, s.connections, s.slow_readers, s.health, s.pushes,
                                    socket_timeout=60, timeout=s.client_timeout)
    return report


def _slow_row(mode: str, part: dict[str, Any]) -> list[Any]:
    loaded = part["under_attack"]
    return [f"slow_clients.{mode} ({part['connections']}+{part['slow_readers']} conns)", loaded["requests"],
            loaded["status_5xx"], loaded["no_answer"], part["peak_rss_growth_mb"], loaded["health"]["p99_s"],
            loaded["push_5mb"]["p99_s"]]


# big compressed pushes (defect 6) ----------------------------------------------------

@attack("compressed_pushes", rows=lambda part: [_row("compressed_pushes", part)], tallies=lambda part: [part])
def compressed(data_dir: Path, s: Settings) -> dict[str, Any]:
    log.info("%d concurrent fp16 pushes of a %d MiB model", 8, s.model_mb)
    return compressed_pushes(data_dir, s.model_mb)


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
