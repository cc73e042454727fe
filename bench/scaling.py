#!/usr/bin/env python3
"""Scaling benchmark: aggregate training throughput and sync overhead of one expert's workers.

Each configuration is a fresh coordinator on loopback and real `run_worker.py` processes training
one expert (sql_expert, tiny-qwen2, one torch thread per process):

- 1, 2 and 4 independent workers (separate processes, each its own coordinator client);
- 1 worker of 2 data-parallel processes (`torchrun --nproc_per_node 2`, gloo on CPU).

Figures come from the workers' own per-sync records (--results), over the window in which every
worker of the configuration was training (workers start a few seconds apart): aggregate tokens/s
is the sum over workers of the tokens of the intervals inside that window divided by its length,
sync overhead the share of that time spent in syncs (push, pull, and the ranks' weight broadcast).
This machine has 2 cores, shared: more than two busy processes cannot add throughput here, so read
the 4-worker row as the cost of oversubscription, not as a scaling limit of the system.

    python -m bench.scaling            # ~2.5 min on 2 cores
    python -m bench.scaling --quick    # 1 worker and 1 x 2 processes, a few seconds each

Table on stdout, progress on stderr, results in bench/results/scaling.json.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import format_table, running_coordinator
from bench.harness import Bench, Run
from protocol.cli import option
from protocol.client import CoordinatorClient

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench.scaling")

SPECIALTY = "sql_expert"


@dataclass(frozen=True)
class Configuration:
    name: str
    workers: int
    """Independent worker processes, each a coordinator client."""
    processes: int
    """Data-parallel processes per worker (torchrun --nproc_per_node)."""


CONFIGURATIONS = (Configuration("1 worker", 1, 1), Configuration("2 workers", 2, 1), Configuration("4 workers", 4, 1),
                  Configuration("1 worker x 2 processes", 1, 2))
QUICK_CONFIGURATIONS = (CONFIGURATIONS[0], CONFIGURATIONS[3])


@dataclass(frozen=True)
class Settings:
    duration: float = option(24.0, "seconds each worker trains (after its own start-up)")
    sync_interval: float = 3.0
    """Seconds between syncs."""
    batch_size: int = 8
    """Examples per optimiser step (the global batch of a data-parallel worker)."""
    max_seq_len: int = 128
    """Tokens per example."""
    configurations: tuple[Configuration, ...] = CONFIGURATIONS
    """Worker and process counts run, one after another."""

    def __post_init__(self) -> None:
        if not self.duration > 0:
            raise ValueError(f"--duration must be positive, got {self.duration}")


def worker_command(config: Configuration, index: int, url: str, results: Path, settings: Settings) -> list[str]:
    launcher = [sys.executable]
    if config.processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={config.processes}"]
    return launcher + [
        str(ROOT / "run_worker.py"), "--specialty", SPECIALTY, "--base-model", "tiny-qwen2", "--device", "cpu",
        "--coordinator-url", url, "--worker-id", f"scaling-{index}", "--results", str(results),
        "--state-dir", str(results.with_suffix(".state")),  # beside the results: a run never resumes another
        "--duration", str(settings.duration), "--sync-interval", str(settings.sync_interval),
        "--batch-size", str(settings.batch_size), "--max-seq-len", str(settings.max_seq_len)]


def run_configuration(config: Configuration, settings: Settings, scratch: Path) -> dict[str, Any]:
    """Start the configuration's workers against a fresh coordinator; returns its record."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    paths = [scratch / f"{config.workers}x{config.processes}-{i}.jsonl" for i in range(config.workers)]
    with running_coordinator() as url:
        procs = [subprocess.Popen(worker_command(config, i, url, path, settings), cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for i, path in enumerate(paths)]
        errors = [p.communicate(timeout=settings.duration + 240)[1] for p in procs]
        failed = [(p.returncode, e) for p, e in zip(procs, errors) if p.returncode != 0]
        if failed:
            raise RuntimeError(f"{config.name}: worker exited {failed[0][0]}:\n{failed[0][1][-3000:]}")
        seen = len(CoordinatorClient(url).workers.list())
    records = [[json.loads(line) for line in path.read_text().splitlines()] for path in paths]
    return {**asdict(config), "workers_seen_by_coordinator": seen, **window_figures(records)}


def window_figures(per_worker: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """Throughput and sync share over the window in which every worker was training.

    A worker's record i is written at the start of sync i and carries the tokens trained since sync
    i - 1 ended, so intervals i..j fill the time from record i - 1 to record j.
    """
    # --results also holds per-step lines ("event": "step") of data-parallel workers: only sync lines count here
    syncs = [[r for r in records if r.get("event") != "step" and not r["final"] and "tokens" in r]
             for records in per_worker]
    if any(len(s) < 2 for s in syncs):
        raise RuntimeError("a worker synced fewer than twice; raise --duration")
    start = max(s[0]["time"] for s in syncs)
    end = min(s[-1]["time"] for s in syncs)
    tokens_per_second, sync_seconds, span_total, steps = 0.0, 0.0, 0.0, 0
    for s in syncs:
        inside = [i for i in range(1, len(s)) if s[i - 1]["time"] >= start and s[i]["time"] <= end]
        if not inside:  # no whole interval inside the common window: use this worker's whole run
            inside = list(range(1, len(s)))
        span = s[inside[-1]]["time"] - s[inside[0] - 1]["time"]
        tokens_per_second += sum(s[i]["tokens"] for i in inside) / span
        sync_seconds += sum(s[i - 1]["sync_seconds"] for i in inside)
        span_total += span
        steps += sum(s[i]["steps"] for i in inside)
    return {"tokens_per_second": round(tokens_per_second, 1),
            "sync_overhead_pct": round(100 * sync_seconds / span_total, 2),
            "common_window_seconds": round(max(end - start, 0.0), 2), "steps_in_window": steps,
            "syncs": sum(len(s) for s in syncs)}


def render(report: dict[str, Any]) -> str:
    headers = ["configuration", "processes", "tokens/s", "vs 1 worker", "sync overhead %", "window s", "syncs"]
    rows = [[r["name"], r["workers"] * r["processes"], r["tokens_per_second"], r["speedup_vs_1_worker"],
             r["sync_overhead_pct"], r["common_window_seconds"], r["syncs"]] for r in report["records"]]
    return (f"one expert, tiny-qwen2, {report['machine']['cpu_cores']} CPU cores (shared), one torch thread per "
            f"process\n" + format_table(headers, rows))


def run(s: Settings, ctx: Run) -> int:
    records = []
    with tempfile.TemporaryDirectory(prefix="fedmoe-scaling-") as scratch:
        for config in s.configurations:
            log.info("%s: %d worker(s) x %d process(es), %.0f s", config.name, config.workers, config.processes,
                     s.duration)
            records.append(run_configuration(config, s, Path(scratch)))
    baseline = records[0]["tokens_per_second"]
    for r in records:
        r["speedup_vs_1_worker"] = round(r["tokens_per_second"] / baseline, 3)
    report = {"machine": {"cpu_cores": os.cpu_count(),
                          "note": "a 2-core machine shared with other jobs: beyond 2 busy processes the workers "
                                  "share cores, so aggregate throughput cannot grow; figures are noisy"},
              "settings": asdict(s), "records": records, "seconds": ctx.seconds()}
    ctx.write(report)
    print(render(report))
    log.info("wrote %s in %.0f s", ctx.out, report["seconds"])
    return 0


BENCH = Bench("scaling", tags=("robustness",), settings=Settings, run=run,
              quick={"duration": 5.0, "sync_interval": 1.0, "configurations": QUICK_CONFIGURATIONS})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
