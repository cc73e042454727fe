#!/usr/bin/env python3
"""Run every benchmark in turn (`make bench`); each prints its table and writes bench/results/<name>.json."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ("compression.py", "gateway.py", "byzantine.py")


def main() -> int:
    failed = []
    for name in BENCHMARKS:
        print(f"\n=== bench/{name} ===", flush=True)
        started = time.monotonic()
        code = subprocess.call([sys.executable, str(HERE / name), *sys.argv[1:]])
        print(f"=== bench/{name}: exit {code} after {time.monotonic() - started:.0f} s ===", flush=True)
        if code:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
