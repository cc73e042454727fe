#!/usr/bin/env python3
"""A/B of the 1 GiB push in one window: another checkout (client and coordinator) against this one, alternated.

Each run is ``python -m bench.transport --push-only`` in its own process, with ``FEDMOE_BENCH_SERVER_ROOT`` and
``FEDMOE_BENCH_CLIENT_ROOT`` pointing at the checkout under test, so both ends of the push are that checkout's.
The other checkout runs first in every pair. Per side: each push's ratio to the raw socket copy measured just before
it, wall seconds, the coordinator's and the client's CPU seconds, and the load average.

    python -m bench.transport_ab --baseline /work/main --pairs 3 --repeats 2

Table on stdout, progress on stderr, results in bench/results/transport_ab.json.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import format_table
from bench.harness import Bench, Run, git_head
from protocol.cli import option

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.transport_ab")


def one_side(root: Path, size_mb: int, repeats: int) -> dict[str, Any]:
    """One ``bench.transport --push-only`` run with both ends from ``root``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "push.json"
        env = {**os.environ, "FEDMOE_BENCH_SERVER_ROOT": str(root), "FEDMOE_BENCH_CLIENT_ROOT": str(root),
               "HF_HUB_OFFLINE": "1"}
        subprocess.run([sys.executable, "-m", "bench.transport", "--push-only", "--size-mb", str(size_mb),
                        "--repeats", str(repeats), "--out", str(out)], cwd=ROOT, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in runs)

    return {"pushes": len(runs), "push_vs_socket_mean": mean("push_vs_socket"),
            "push_vs_socket_best": max(r["push_vs_socket"] for r in runs), "push_seconds_mean": mean("push_seconds"),
            "push_seconds_best": min(r["push_seconds"] for r in runs), "socket_seconds_mean": mean("socket_seconds"),
            "coordinator_cpu_per_push": mean("coordinator_cpu_seconds"), "client_cpu_per_push": mean("client_cpu_seconds"),
            "load_min": min(r["load_average"] for r in runs), "load_max": max(r["load_average"] for r in runs)}


def render(result: dict[str, Any]) -> str:
    a, b = result["baseline"]["summary"], result["change"]["summary"]
    keys = ("push_vs_socket_mean", "push_vs_socket_best", "push_seconds_mean", "push_seconds_best",
            "coordinator_cpu_per_push", "client_cpu_per_push", "socket_seconds_mean", "load_min", "load_max")
    rows = [(k, a[k], b[k], b[k] / a[k] if a[k] else float("nan")) for k in keys]
    table = format_table(("", f"baseline {result['baseline']['commit']}", f"change {result['change']['commit']}",
                          "change / baseline"), rows, align="lrrr")
    return f"1 GiB push A/B, {result['pairs']} pairs x {result['repeats']} pushes per side\n\n{table}"


@dataclass(frozen=True)
class Settings:
    baseline: Path | None = option(None, "the other checkout, e.g. a worktree of main (required)", type=Path)
    pairs: int = option(3, "baseline/change pairs, alternated")
    repeats: int = option(2, "pushes per run")
    size_mb: int = option(1024, "push size in MiB")

    def __post_init__(self) -> None:
        if self.pairs < 1 or self.repeats < 1 or self.size_mb < 1:
            raise ValueError("--pairs, --repeats and --size-mb must be at least 1")
        if self.baseline is not None and not (self.baseline / "run_coordinator.py").is_file():
            raise ValueError(f"--baseline {self.baseline} is not a FedMoE checkout (no run_coordinator.py there)")


def run(s: Settings, ctx: Run) -> int:
    if s.baseline is None:
        print("error: --baseline is required: the checkout to compare this one with", file=sys.stderr)
        return 2
    sides: dict[str, dict[str, Any]] = {
        "baseline": {"root": str(s.baseline), "commit": git_head(s.baseline), "runs": []},
        "change": {"root": str(ROOT), "commit": git_head(ROOT), "runs": []}}
    for pair in range(s.pairs):
        for name in ("baseline", "change"):
            got = one_side(Path(sides[name]["root"]), s.size_mb, s.repeats)
            for one in got["runs"]:
                one["pair"] = pair
            sides[name]["runs"].extend(got["runs"])
            log.info("pair %d %s: %s", pair + 1, name, ", ".join(
                f"{r['push_vs_socket']:.3f} ({r['push_seconds']:.2f} s, coordinator {r['coordinator_cpu_seconds']:.2f} "
                f"CPU s, load {r['load_average']:.1f})" for r in got["runs"]))
    for side in sides.values():
        side["summary"] = summary(side["runs"])
    result = {"benchmark": "1 GiB resumable push, A/B (bench.transport --push-only)", "pairs": s.pairs,
              "repeats": s.repeats, "size_mb": s.size_mb, **sides, "seconds": ctx.seconds()}
    ctx.write(result)
    print(render(result))
    return 0


BENCH = Bench("transport_ab", tags=("a-b",), settings=Settings, run=run, quick={"pairs": 1, "repeats": 1, "size_mb": 64},
              torch_threads=None)
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
