#!/usr/bin/env python3
"""Does reading the gateway grow the data dir? A worker pushing and a dashboard polling, for minutes.

Issue 14 found that ``GET /api/v1/gateway`` built and durably stored a new gateway whenever the
experts had changed, and nothing ever deleted one: with a worker pushing every few seconds and the
dashboard polling every 5 s, the data dir grew by a gateway per poll. Now gateways are built in
the background after aggregation (at most one per ``--gateway-interval``) and only the newest
``--keep-gateways`` are kept.

A real run_coordinator.py (default flags) serves two experts; one client pushes a small real
update to one of them every ``--push-every`` seconds, another polls the gateway (and the expert
list) every ``--poll-every`` seconds, as the dashboard does. Every ``--sample-every`` seconds the
data dir's size and file count are sampled. Reported: growth over the run, the growth rate over
its second half (least-squares slope: steady state) and the files left at the end.

    python -m bench.gateway_growth                 # 10 minutes, the issue's figure
    python -m bench.gateway_growth --minutes 1     # a quick look
    FEDMOE_BENCH_SERVER_ROOT=../old-checkout python -m bench.gateway_growth   # the same against another checkout

Table on stdout, progress on stderr, results in bench/results/gateway_growth.json.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import torch

from bench.common import CoordinatorProcess, format_table
from bench.crash import FINGERPRINT
from bench.harness import Bench, Run
from protocol.cli import option
from protocol.schemas import EXPERT_HEADER, UPDATE_HEADER
from protocol.tensors import dumps

log = logging.getLogger("bench.gateway_growth")
EXPERTS = ("growth_a", "growth_b")
RANK, HIDDEN, LAYERS = 8, 896, 24
"""q_proj and v_proj of a Qwen2-0.5B-wide model at rank 8: 2.75 MB of fp32 per adapter (and per gateway)."""
SPEC = {"lora": {"rank": RANK, "alpha": 2.0 * RANK, "target_modules": ["q_proj", "v_proj"]},
        "base_model": {"id": "growth-test", "fingerprint": FINGERPRINT}}


def adapter(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(LAYERS):
        for proj in ("q_proj", "v_proj"):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            out[f"{key}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=g) * scale
            out[f"{key}.lora_B.weight"] = torch.randn(HIDDEN, RANK, generator=g) * scale
    return out


def dir_size(path: Path) -> tuple[int, int]:
    """(bytes, files) of everything under path; files that vanish while walking are skipped."""
    total = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.stat(os.path.join(root, name)).st_size
                files += 1
            except FileNotFoundError:
                pass
    return total, files


def steady_rate(samples: Sequence[tuple[float, int, int]]) -> float:
    """Bytes per minute over the second half of the run: the least-squares slope, so that one version
    being written at the moment of a sample does not read as growth."""
    half = samples[len(samples) // 2:]
    if len(half) < 2:
        return 0.0
    mean_t = sum(t for t, _, _ in half) / len(half)
    mean_b = sum(b for _, b, _ in half) / len(half)
    var = sum((t - mean_t) ** 2 for t, _, _ in half)
    return sum((t - mean_t) * (b - mean_b) for t, b, _ in half) / var * 60 if var else 0.0


class Loop(threading.Thread):
    """Calls ``step`` every ``every`` seconds until stopped; counts answers by status code."""

    def __init__(self, every: float, step: Any) -> None:
        super().__init__(daemon=True)
        self.every, self.step = every, step
        self.stopping = threading.Event()
        self.codes: dict[int, int] = {}

    def run(self) -> None:
        while not self.stopping.wait(self.every):
            code = self.step()
            self.codes[code] = self.codes.get(code, 0) + 1


def run(minutes: float, push_every: float, poll_every: float, sample_every: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fedmoe-growth-") as tmp:
        server = CoordinatorProcess(Path(tmp))
        server.start()
        session = requests.Session()
        session.headers.update(server.headers)
        try:
            for i, name in enumerate(EXPERTS):
                session.put(f"{server.url}/api/v1/experts/{name}", data=dumps(adapter(i)),
                            headers={EXPERT_HEADER: json.dumps(SPEC)}, timeout=30).raise_for_status()
            counter = iter(range(1, 1 << 30))

            def push() -> int:
                n = next(counter)
                meta = {"update_id": f"growth-{n}", "base_version": 0, "num_samples": 4}
                return session.post(f"{server.url}/api/v1/experts/{EXPERTS[0]}/updates",
                                    data=dumps(adapter(1000 + n, scale=0.01)),
                                    headers={UPDATE_HEADER: json.dumps(meta)}, timeout=30).status_code

            def poll() -> int:
                session.get(f"{server.url}/api/v1/experts", timeout=30)
                return session.get(f"{server.url}/api/v1/gateway", timeout=60).status_code

            samples = [(0.0, *dir_size(Path(tmp)))]
            loops = [Loop(push_every, push), Loop(poll_every, poll)]
            for loop in loops:
                loop.start()
            started = time.monotonic()
            while (elapsed := time.monotonic() - started) < minutes * 60:
                time.sleep(min(sample_every, minutes * 60 - elapsed))
                samples.append((round(time.monotonic() - started, 1), *dir_size(Path(tmp))))
                log.info("%5.0f s: data dir %.2f MB in %d files", samples[-1][0], samples[-1][1] / 1e6, samples[-1][2])
            for loop in loops:
                loop.stopping.set()
                loop.join(timeout=60)
            gateway = session.get(f"{server.url}/api/v1/gateway", timeout=60)
        finally:
            server.stop()
    end = samples[-1]
    return {
        "server_root": os.environ.get("FEDMOE_BENCH_SERVER_ROOT") or "this checkout",
        "minutes": minutes, "push_every_s": push_every, "poll_every_s": poll_every,
        "pushes": loops[0].codes, "polls": loops[1].codes,
        "start_bytes": samples[0][1], "end_bytes": end[1], "growth_bytes": end[1] - samples[0][1],
        "end_files": end[2], "steady_growth_bytes_per_min": round(steady_rate(samples)),
        "gateway_status": gateway.status_code,
        "samples": [{"t": t, "bytes": b, "files": f} for t, b, f in samples],
    }


@dataclass(frozen=True)
class Settings:
    minutes: float = option(10.0, "how long to push and poll")
    push_every: float = option(2.0, "seconds between pushes")
    poll_every: float = option(5.0, "seconds between gateway polls, the dashboard's rate")
    sample_every: float = option(30.0, "seconds between size samples")

    def __post_init__(self) -> None:
        for name in ("minutes", "push_every", "poll_every", "sample_every"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")


def run_bench(s: Settings, ctx: Run) -> int:
    report = run(s.minutes, s.push_every, s.poll_every, s.sample_every)
    ctx.write(report)
    print(format_table(["server", "minutes", "pushes", "polls", "growth MB", "steady MB/min", "files at end"],
                       [[report["server_root"], report["minutes"], sum(report["pushes"].values()),
                         sum(report["polls"].values()), round(report["growth_bytes"] / 1e6, 3),
                         round(report["steady_growth_bytes_per_min"] / 1e6, 3), report["end_files"]]]))
    return 0


BENCH = Bench("gateway_growth", tags=("durability",), settings=Settings, run=run_bench,
              quick={"minutes": 1.0, "sample_every": 10.0})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
