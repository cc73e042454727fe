#!/usr/bin/env python3
"""A/B of the 1 GiB push in one window: another checkout (client and coordinator) against this one, alternated.

Each run is ``python -m bench.transport --push-only`` in its own process, with ``FEDMOE_BENCH_SERVER_ROOT`` and
``FEDMOE_BENCH_CLIENT_ROOT`` pointing at the checkout under test, so both ends of the push are that checkout's.
The other checkout runs first in every pair. Per side: each push's ratio to the raw socket copy measured just before
it, wall seconds, the coordinator's and the client's CPU seconds, and the load average.

    python -m bench.transport_ab --baseline /work/main --pairs 3 --repeats 2

Table on stdout, progress on stderr, results in bench/results/transport_push_ab.json.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, configure_logging, format_table, write_json_atomic

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.transport_ab")


def git_head(root: Path) -> str:
    """The checkout's commit, with "+changes" when its work tree differs from it."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, default=Path("/work/main"), help="the other checkout (default: %(default)s)")
    p.add_argument("--pairs", type=int, default=3, help="baseline/change pairs, alternated (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="pushes per run (default: %(default)s)")
    p.add_argument("--size-mb", type=int, default=1024, help="push size in MiB (default: %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "transport_push_ab.json", help="results JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="library logs too")
    args = p.parse_args(argv)
    if args.pairs < 1 or args.repeats < 1 or args.size_mb < 1:
        p.error("--pairs, --repeats and --size-mb must be at least 1")
    if not (args.baseline / "run_coordinator.py").is_file():
        p.error(f"--baseline {args.baseline} is not a FedMoE checkout (no run_coordinator.py there)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.verbose)
    started = time.perf_counter()
    sides: dict[str, dict[str, Any]] = {
        "baseline": {"root": str(args.baseline), "commit": git_head(args.baseline), "runs": []},
        "change": {"root": str(ROOT), "commit": git_head(ROOT), "runs": []}}
    for pair in range(args.pairs):
        for name in ("baseline", "change"):
            got = one_side(Path(sides[name]["root"]), args.size_mb, args.repeats)
            for run in got["runs"]:
                run["pair"] = pair
            sides[name]["runs"].extend(got["runs"])
            log.info("pair %d %s: %s", pair + 1, name, ", ".join(
                f"{r['push_vs_socket']:.3f} ({r['push_seconds']:.2f} s, coordinator {r['coordinator_cpu_seconds']:.2f} "
                f"CPU s, load {r['load_average']:.1f})" for r in got["runs"]))
    for side in sides.values():
        side["summary"] = summary(side["runs"])
    result = {"benchmark": "1 GiB resumable push, A/B (bench.transport --push-only)", "pairs": args.pairs,
              "repeats": args.repeats, "size_mb": args.size_mb, **sides,
              "seconds": round(time.perf_counter() - started, 1)}
    write_json_atomic(args.out, result)
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
