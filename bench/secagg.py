#!/usr/bin/env python3
"""What secure aggregation costs per sync: bytes on the wire and CPU seconds, with and without masking,
and the time to recover a cohort when 1 of its K members drops after masking.

In-process and real: K workers' ``CohortSession``s talk to a ``SecureAggregator`` (its journal on disk
in a temp dir, real fsyncs) through a transport that counts every request and response body as the
HTTP layer would carry it (JSON, base64 for binary, the masked input as raw uint32). Real X25519,
HKDF, ChaCha20(-Poly1305) and Shamir. The baseline is the plain push of today: one fp32 safetensors
body per worker, summed by the aggregator. HTTP framing (a few hundred bytes a request) is left out
of both. Sizes are LoRA rank 8 on all seven projections of:

- ``tiny-qwen2`` (the tests' preset: hidden 128, 2 layers, MLP 344, 4 heads / 2 KV heads);
- ``smollm2-135m`` (SmolLM2-135M: hidden 576, 30 layers, MLP 1536, 9 heads / 3 KV heads).

Columns: ``setup s`` is a worker's CPU for the rounds done before its update is ready (keys, shares),
``worker s`` the sync itself (plain: serialising; masked: quantising, K masks, and, in process, the
aggregator journalling the input before its answer), ``aggregator s`` summing (plain) or unmasking,
``recovery s`` from the moment the last input arrived (or the dropout's deadline passed) to the sum
being ready: the unmasking round plus the unmasking.

Each arm is repeated ``--repeats`` times in ABAB order (plain, masked, plain, ...), so load drift
hits both; the table shows medians.

    python -m bench.secagg                 # K = 4, 5 repeats, ~1 min
    python -m bench.secagg --members 8

Table on stdout, results in bench/results/secagg.json (commit and load average stamped).
"""
from __future__ import annotations

import sys
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.harness import Bench, Run
from bench.common import format_table
from privacy.secagg.aggregator import SecAggSettings, SecureAggregator
from privacy.secagg.journal import CohortJournal
from privacy.secagg.session import CohortSession
from protocol.cli import option
from protocol.tensors import dumps, loads

RANK = 8
MODELS = {  # hidden, layers, intermediate, heads, kv heads
    "tiny-qwen2": (128, 2, 344, 4, 2),
    "smollm2-135m": (576, 30, 1536, 9, 3),
}


def lora_numel(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, rank: int = RANK) -> int:
    """Values in a rank-r LoRA adapter on q, k, v, o, gate, up, down: r * (in + out) per projection."""
    kv = hidden // heads * kv_heads
    shapes = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden),
              (hidden, intermediate), (hidden, intermediate), (intermediate, hidden)]
    return layers * sum(rank * (a + b) for a, b in shapes)


class CountingTransport:
    """The aggregator's methods, each call's request and response bodies counted per worker (as HTTP carries them)."""

    def __init__(self, aggregator: SecureAggregator) -> None:
        self.aggregator = aggregator
        self.sent: dict[str, int] = defaultdict(int)
        self.received: dict[str, int] = defaultdict(int)
        self.requests: dict[str, int] = defaultdict(int)

    def _call(self, worker: str, method: Callable[..., dict[str, Any]], *args: Any, body: Any = None,
              raw: bytes | None = None, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        self.requests[worker] += 1
        self.sent[worker] += len(raw) + len(json.dumps(meta)) if raw is not None else len(json.dumps(body or {}))
        answer = method(*args) if raw is None and body is None else (
            method(*args, raw, meta) if raw is not None else method(*args, body))
        self.received[worker] += len(json.dumps(answer))
        return answer

    def join(self, expert: str, worker: str) -> dict[str, Any]:
        return self._call(worker, self.aggregator.join, expert, worker)

    def status(self, cohort_id: str, worker: str) -> dict[str, Any]:
        return self._call(worker, self.aggregator.status, cohort_id, worker)

    def post_keys(self, cohort_id: str, worker: str, body: Any) -> dict[str, Any]:
        return self._call(worker, self.aggregator.post_keys, cohort_id, worker, body=body)

    def post_shares(self, cohort_id: str, worker: str, body: Any) -> dict[str, Any]:
        return self._call(worker, self.aggregator.post_shares, cohort_id, worker, body=body)

    def shares_for(self, cohort_id: str, worker: str) -> dict[str, Any]:
        return self._call(worker, self.aggregator.shares_for, cohort_id, worker)

    def post_masked(self, cohort_id: str, worker: str, body: bytes, meta: dict[str, Any]) -> dict[str, Any]:
        return self._call(worker, self.aggregator.post_masked, cohort_id, worker, raw=body, meta=meta)

    def post_answer(self, cohort_id: str, worker: str, body: Any) -> dict[str, Any]:
        return self._call(worker, self.aggregator.post_answer, cohort_id, worker, body=body)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def plain_sync(deltas: dict[str, np.ndarray]) -> dict[str, float]:
    """Today's push: each worker serialises its fp32 delta; the aggregator parses and sums them."""
    bodies: dict[str, bytes] = {}
    encode = []
    for worker, delta in deltas.items():
        start = time.perf_counter()
        bodies[worker] = dumps({"delta": torch.from_numpy(delta.astype(np.float32))})
        encode.append(time.perf_counter() - start)

    def aggregate() -> np.ndarray:
        total = np.zeros(next(iter(deltas.values())).size)
        for body in bodies.values():
            total += loads(body)["delta"].numpy()
        return total

    _, aggregate_s = timed(aggregate)
    return {"bytes_up_per_worker": statistics.mean(len(b) for b in bodies.values()), "bytes_down_per_worker": 0,
            "requests_per_worker": 1, "worker_s": statistics.median(encode), "aggregator_s": aggregate_s}


def masked_sync(deltas: dict[str, np.ndarray], drop: int, folder: Path) -> dict[str, float]:
    """One cohort through every round; ``drop`` members vanish after masking (they never send their input)."""
    workers = list(deltas)
    numel = next(iter(deltas.values())).size
    clock = [0.0]
    settings = SecAggSettings(cohort_size=len(workers), clip=1.0, max_weight=4096, round_timeout=10, input_timeout=100)
    aggregator = SecureAggregator(CohortJournal(folder), settings, lambda expert: numel, lambda: clock[0])
    transport = CountingTransport(aggregator)
    sessions = {w: CohortSession(transport, "expert", w) for w in workers}
    setup: dict[str, float] = defaultdict(float)
    for _ in range(4):  # join, keys, shares, opening the shares: the setup done ahead of the update
        for worker, session in sessions.items():
            setup[worker] += timed(session.advance)[1]
    masking = {}
    for worker in workers[:len(workers) - drop]:
        start = time.perf_counter()
        sessions[worker].submit(deltas[worker], 16, {"base_version": 0}, 7)
        masking[worker] = time.perf_counter() - start
    recovery_start = time.perf_counter()
    if drop:
        clock[0] += 101  # the input deadline passes: the aggregator unmasks without the dropped
        aggregator.tick()
    answer: dict[str, float] = defaultdict(float)
    for worker in workers[:len(workers) - drop]:
        answer[worker] += timed(sessions[worker].advance)[1]
    ready, unmask_s = timed(aggregator.ready)
    recovery_s = time.perf_counter() - recovery_start
    expected = sum(deltas[w] for w in workers[:len(workers) - drop]) / (len(workers) - drop)
    error = float(np.abs(ready[0].mean - expected).max())
    alive = workers[:len(workers) - drop]
    return {"bytes_up_per_worker": statistics.mean(transport.sent[w] for w in alive),
            "bytes_down_per_worker": statistics.mean(transport.received[w] for w in alive),
            "requests_per_worker": statistics.mean(transport.requests[w] for w in alive),
            "worker_setup_s": statistics.median(setup[w] for w in alive),
            "worker_s": statistics.median(masking.values()), "worker_answer_s": statistics.median(answer.values()),
            "aggregator_s": unmask_s, "recovery_s": recovery_s, "max_error": error}


def measure(model: str, members: int, repeats: int) -> dict[str, Any]:
    numel = lora_numel(*MODELS[model])
    rng = np.random.default_rng(0)
    deltas = {f"w{i}": rng.normal(0, 1e-3, numel) for i in range(members)}
    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    for _ in range(repeats):
        runs["plain"].append(plain_sync(deltas))
        with tempfile.TemporaryDirectory(prefix="bench-secagg-") as folder:
            runs["masked"].append(masked_sync(deltas, 0, Path(folder)))
        with tempfile.TemporaryDirectory(prefix="bench-secagg-") as folder:
            runs["masked, 1 drops"].append(masked_sync(deltas, 1, Path(folder)))
    medians = {arm: {key: statistics.median(run[key] for run in rs) for key in rs[0]} for arm, rs in runs.items()}
    return {"model": model, "numel": numel, "members": members, "arms": medians, "runs": runs}


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    for result in results:
        plain = result["arms"]["plain"]
        for arm, m in result["arms"].items():
            rows.append([result["model"], arm, round(m["bytes_up_per_worker"] / 1e6, 3),
                         round(m["bytes_up_per_worker"] / plain["bytes_up_per_worker"], 3),
                         round(m["bytes_down_per_worker"] / 1e3, 1), m["requests_per_worker"],
                         round(m.get("worker_setup_s", 0.0), 4), round(m["worker_s"], 4),
                         round(m["aggregator_s"], 4), m.get("recovery_s"), m.get("max_error")])
    return format_table(["model", "arm", "MB up/worker", "x plain", "kB down", "requests", "setup s", "worker s",
                         "aggregator s", "recovery s", "max |err|"], rows)


@dataclass(frozen=True)
class Settings:
    members: int = option(4, "K: workers per cohort")
    repeats: int = option(5, "ABAB repeats of each arm")
    models: tuple[str, ...] = option(tuple(MODELS), "models to measure", nargs="+", choices=list(MODELS))

    def __post_init__(self) -> None:
        if self.members < 2 or self.repeats < 1:
            raise ValueError("--members must be at least 2 and --repeats at least 1")


def run(s: Settings, ctx: Run) -> int:
    results = [measure(model, s.members, s.repeats) for model in s.models]
    print(table(results))
    ctx.write({"bench": "secagg", "members": s.members, "repeats": s.repeats, "results": results})
    return 0


BENCH = Bench("secagg", tags=("privacy", "training"), settings=Settings, run=run, cores=1,
              quick={"repeats": 1, "models": tuple(MODELS)[:1]})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
