#!/usr/bin/env python3
"""Run a group of benchmarks in turn; each prints its table and writes bench/results/<name>.json.

    python -m bench.run_all              # performance: transport, aggregation, sync overhead, load (~8 min)
    python -m bench.run_all --quality    # learning quality and robustness (~25 min on 2 cores)
    python -m bench.run_all --all

`make bench` runs the first group, which must stay under 10 minutes on 2 cores; `make bench-quality`
the second. Arguments after the flags are passed to every benchmark.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PERFORMANCE = ("transport", "aggregation", "overhead", "load")
QUALITY = ("compression", "gateway", "byzantine", "scaling", "learning", "crash", "hostile")


def main(argv: list[str]) -> int:
    group = PERFORMANCE
    if argv and argv[0] in ("--quality", "--all"):
        group = QUALITY if argv[0] == "--quality" else PERFORMANCE + QUALITY
        argv = argv[1:]
    failed = []
    started_all = time.monotonic()
    for name in group:
        print(f"\n=== bench.{name} ===", flush=True)
        started = time.monotonic()
        code = subprocess.call([sys.executable, "-m", f"bench.{name}", *argv], cwd=ROOT)
        print(f"=== bench.{name}: exit {code} after {time.monotonic() - started:.0f} s ===", flush=True)
        if code:
            failed.append(name)
    print(f"\n{len(group)} benchmark(s) in {time.monotonic() - started_all:.0f} s", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
