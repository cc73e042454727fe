#!/usr/bin/env python3
"""Aggregation benchmark: GB/s of parameter data the coordinator's aggregators apply on one core.

Throughput counts the update data folded into the expert: K updates of an S-byte float32
model applied in t seconds is K * S / t. ``fedasync`` applies one update, ``fedbuff`` a
buffer of K = 3 (sample- and staleness-weighted). The aggregators update the current weights
in place (no copy of the model per step), reading each delta's tensors as they are needed.

Two figures per rule, best of ``--repeats``:

- ``gbps``: the aggregator alone, on tensors in memory (what the target is about);
- ``step_gbps``: a whole coordinator step as ``AggregationSteps.apply`` (coordinator/steps.py) runs it, deltas read one
  tensor at a time from their stored blobs, the current version loaded, the new one written,
  fsynced and hashed (data dir in RAM when there is one), so it shows what the I/O around the
  maths costs.

    python -m bench.aggregation              # a 256 MiB model, about 30 s
    python -m bench.aggregation --size-mb 4  # smoke test

Table on stdout, results in bench/results/aggregation.json.
"""
from __future__ import annotations

import logging
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch

from bench.common import SCRATCH_DIR, format_table
from bench.harness import Bench, Run
from coordinator.aggregation import AGGREGATORS, AggregationParams, Update
from coordinator.config import CoordinatorConfig
from coordinator.service import Coordinator
from protocol.cli import option
from protocol.schemas import ExpertSpec, UpdateMeta
from protocol.tensors import save_file

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench.aggregation")
MiB = 1 << 20
TARGET_GBPS = 1.0
BUFFER = 3


def model(size_mb: int, seed: int) -> dict[str, torch.Tensor]:
    """``size_mb`` MiB of float32 in 16 tensors."""
    g = torch.Generator().manual_seed(seed)
    per = size_mb * MiB // 4 // 16
    return {f"model.layers.{i}.mlp.weight": torch.randn(per, generator=g) * 0.01 for i in range(16)}


def in_memory_seconds(rule: str, size_mb: int, k: int, repeats: int) -> float:
    updates = [Update(model(size_mb, seed=1 + i), num_samples=10 + i, staleness=i) for i in range(k)]
    current = model(size_mb, seed=0)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        current = AGGREGATORS[rule](current, updates, AggregationParams())
        times.append(time.perf_counter() - started)
    return min(times)


def coordinator_step_seconds(rule: str, size_mb: int, k: int, repeats: int) -> float:
    """Seconds of ``AggregationSteps.apply`` (coordinator/steps.py) for k stored updates, as reported by its metrics hook."""
    times: list[float] = []
    with tempfile.TemporaryDirectory(dir=SCRATCH_DIR) as scratch:
        config = CoordinatorConfig(data_dir=Path(scratch) / "data", aggregation=rule, buffer_size=k)
        c = Coordinator(config)
        c.on_aggregated = times.append
        try:
            weights = model(size_mb, seed=0)
            spec = ExpertSpec.from_json({"kind": "full", "base_model": {"id": "bench", "fingerprint": "ab" * 32},
                                         "full": {"num_parameters": sum(t.numel() for t in weights.values())}})
            c.create_expert("x", spec, write(c, weights))
            deltas = [write(c, model(size_mb, seed=1 + i)) for i in range(k * repeats)]
            for i, body in enumerate(deltas):
                version = c.require_expert("x").version
                meta = UpdateMeta(update_id=uuid.uuid4().hex, base_version=version, num_samples=10 + i % k)
                c.submit_update("x", meta, body)
        finally:
            c.close()
    return min(times)


def write(c: Coordinator, tensors: dict[str, torch.Tensor]) -> Path:
    return c.store.bodies.write_temp(lambda path: save_file(tensors, path))


class Record(TypedDict):
    """One aggregation rule's figures in the JSON's "records"."""

    rule: str
    updates_per_step: int
    model_bytes: int
    seconds: float
    gbps: float
    step_seconds: float
    step_gbps: float


def measure(size_mb: int, repeats: int) -> dict[str, Any]:
    size = size_mb * MiB
    records: list[Record] = []
    for rule, k in (("fedasync", 1), ("fedbuff", BUFFER)):
        seconds = in_memory_seconds(rule, size_mb, k, repeats)
        step = coordinator_step_seconds(rule, size_mb, k, repeats)
        records.append({"rule": rule, "updates_per_step": k, "model_bytes": size, "seconds": seconds,
                        "gbps": k * size / seconds / 1e9, "step_seconds": step, "step_gbps": k * size / step / 1e9})
        log.info("%s: %.3f s in memory, %.3f s as a coordinator step", rule, seconds, step)
    return {"records": records, "threads": torch.get_num_threads(), "repeats": repeats,
            "gbps": min(r["gbps"] for r in records), "target_gbps": TARGET_GBPS,
            "data_dir": SCRATCH_DIR or "tmp"}


def render(report: dict[str, Any]) -> str:
    rows = [(r["rule"], r["updates_per_step"], r["model_bytes"] // MiB, r["gbps"], r["step_gbps"])
            for r in report["records"]]
    table = format_table(("rule", "updates", "model MiB", "GB/s (aggregator)", "GB/s (coordinator step)"), rows)
    met = "met" if report["gbps"] >= report["target_gbps"] else "NOT met"
    return (f"aggregation on {report['threads']} thread(s)\n\n{table}\n\n"
            f"slowest rule {report['gbps']:.2f} GB/s (target >= {report['target_gbps']}: {met})")


@dataclass(frozen=True)
class Settings:
    size_mb: int = option(256, "model size in MiB")
    repeats: int = option(3, "timed steps per rule, best of")

    def __post_init__(self) -> None:
        if self.size_mb < 1 or self.repeats < 1:
            raise ValueError(f"--size-mb and --repeats must be at least 1, got {self.size_mb} and {self.repeats}")


def run(s: Settings, ctx: Run) -> int:
    report = measure(s.size_mb, s.repeats)
    report["seconds"] = ctx.seconds()
    ctx.write(report)
    print(render(report))
    return 0


BENCH = Bench("aggregation", tags=("performance",), settings=Settings, run=run, quick={"size_mb": 16, "repeats": 1})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
