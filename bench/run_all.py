#!/usr/bin/env python3
"""Run a group of benchmarks; each prints its table and writes bench/results/<name>.json.

    python -m bench.run_all                 # performance: transport, aggregation, sync overhead, load (~8 min)
    python -m bench.run_all --quality       # learning quality on smollm2-135m (make smollm2), two lanes at once
    python -m bench.run_all --quality --quick   # the same suites on tiny-qwen2, a smoke run of a few minutes
    python -m bench.run_all --quality --estimate   # each suite's planned steps and scored problems, priced at
                                                   # the CPU costs its last results JSON measured; runs nothing
                                                   # (--priced-from JSON: at the costs another run measured)
    python -m bench.run_all --robustness    # tiny-qwen2 sweeps, poisoning, scaling, training options, crash, hostile
    python -m bench.run_all --all

`make bench` runs the first group (under 10 minutes on 2 cores), `make bench-quality` the second.
The quality suites run in two lanes, one process each with one torch thread (the machine has 2
cores): compression in one, the gateway then poisoning suites in the other. Arguments after the
group flag are passed to every benchmark of the group.
"""
from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PERFORMANCE: tuple[tuple[str, ...], ...] = (("transport", "aggregation", "overhead", "load"),)
QUALITY: tuple[tuple[str, ...], ...] = (("quality_compression",), ("quality_gateway", "quality_poisoning"))
"""Lanes run side by side; the benchmarks of a lane one after another."""
ROBUSTNESS: tuple[tuple[str, ...], ...] = (("compression", "gateway", "byzantine", "scaling", "learning", "crash",
                                            "hostile"),)
GROUPS = {"--performance": PERFORMANCE, "--quality": QUALITY, "--robustness": ROBUSTNESS}


def run_lanes(lanes: Sequence[Sequence[str]], argv: Sequence[str]) -> list[str]:
    """Run every lane's benchmarks in order, the lanes in parallel; the names of those that failed."""
    failed: list[str] = []
    pending = [list(lane) for lane in lanes]
    running: dict[str, tuple[subprocess.Popen, float, list[str]]] = {}

    def start(lane: list[str]) -> None:
        name = lane.pop(0)
        print(f"=== bench.{name} started ===", flush=True)
        running[name] = (subprocess.Popen([sys.executable, "-m", f"bench.{name}", *argv], cwd=ROOT),
                         time.monotonic(), lane)

    for lane in pending:
        if lane:
            start(lane)
    while running:
        for name, (proc, started, lane) in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[name]
            print(f"=== bench.{name}: exit {code} after {time.monotonic() - started:.0f} s ===", flush=True)
            if code:
                failed.append(name)
            if lane:
                start(lane)
        time.sleep(0.5)
    return failed


def main(argv: list[str]) -> int:
    groups = [PERFORMANCE]
    if argv and argv[0] in (*GROUPS, "--all"):
        groups = list(GROUPS.values()) if argv[0] == "--all" else [GROUPS[argv[0]]]
        argv = argv[1:]
    started_all = time.monotonic()
    failed = [name for lanes in groups for name in run_lanes(lanes, argv)]
    count = sum(len(lane) for lanes in groups for lane in lanes)
    print(f"\n{count} benchmark(s) in {time.monotonic() - started_all:.0f} s", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
