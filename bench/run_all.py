#!/usr/bin/env python3
"""Run the benchmarks of a tag (or by name); each prints its table and writes bench/results/<name>.json.

    python -m bench.run_all                      # tag performance: transport, aggregation, overhead, load (~8 min)
    python -m bench.run_all --tag quality        # learning quality on smollm2-135m (make smollm2)
    python -m bench.run_all --tag quality --quick        # the same suites on tiny-qwen2, a smoke run of minutes
    python -m bench.run_all --tag quality --estimate     # each suite's planned steps and scored problems, priced at
                                                         # the CPU costs its last results JSON measured; runs nothing
    python -m bench.run_all --tag robustness     # tiny-qwen2 sweeps, poisoning, scaling, training options, crash, hostile
    python -m bench.run_all --all                # the three make groups: performance, quality, robustness
    python -m bench.run_all --only transport load
    python -m bench.run_all --list               # every bench: its tags and what it measures

The benchmarks are found, not listed here: every module of bench/ that declares ``BENCH = Bench(...)``
(bench/harness.py). A bench that keeps one core busy (``cores=1``, the quality suites with one torch thread each)
runs beside another; the timing benches take the machine's two cores and run alone. Arguments this runner does not
know (--quick, --estimate, -v) are passed to every benchmark it runs.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence

from bench.common import ROOT
from bench.harness import TAGS, Declared, declared_benches

CORES = 2
"""Cores the benches may keep busy at once (the machine's)."""
MAKE_GROUPS = ("performance", "quality", "robustness")
"""The tags `make bench`, `make bench-quality` and `make bench-robustness` run; --all runs them all."""


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    choose = p.add_mutually_exclusive_group()
    choose.add_argument("--tag", choices=sorted(TAGS), action="append",
                        help="run the benches with this tag (repeatable; default: performance)")
    choose.add_argument("--all", action="store_true", help=f"run every bench tagged {', '.join(MAKE_GROUPS)}")
    choose.add_argument("--only", nargs="+", metavar="NAME", help="run these benches, by name")
    choose.add_argument("--list", action="store_true", help="list every bench, its tags and what it measures")
    for tag in MAKE_GROUPS:  # the spellings `make` used before tags: --performance, --quality, --robustness
        choose.add_argument(f"--{tag}", dest="tag", action="append_const", const=tag, help=argparse.SUPPRESS)
    return p.parse_known_args(argv)


def chosen(args: argparse.Namespace, benches: Sequence[Declared]) -> list[Declared]:
    """The benches the flags select, in name order; ValueError naming any unknown name."""
    if args.only:
        by_name = {b.name: b for b in benches}
        unknown = [n for n in args.only if n not in by_name]
        if unknown:
            raise ValueError(f"--only: no bench named {unknown}; `python -m bench.run_all --list` lists them")
        return [by_name[n] for n in dict.fromkeys(args.only)]
    tags = set(MAKE_GROUPS if args.all else args.tag or ["performance"])
    return [b for b in benches if tags & set(b.tags)]


def run_benches(benches: Sequence[Declared], argv: Sequence[str]) -> list[str]:
    """Run ``benches`` in order, side by side while their cores fit in ``CORES``; the names of those that failed."""
    pending, failed = list(benches), []
    running: dict[str, tuple[subprocess.Popen, float, int]] = {}
    while pending or running:
        busy = sum(cores for _, _, cores in running.values())
        while pending and (not running or busy + pending[0].cores <= CORES):
            bench = pending.pop(0)
            print(f"=== {bench.name} started ===", flush=True)
            running[bench.name] = (subprocess.Popen([sys.executable, "-m", bench.module, *argv], cwd=ROOT),
                                   time.monotonic(), bench.cores)
            busy += bench.cores
        for name, (proc, started, _) in list(running.items()):
            if (code := proc.poll()) is not None:
                del running[name]
                print(f"=== {name}: exit {code} after {time.monotonic() - started:.0f} s ===", flush=True)
                if code:
                    failed.append(name)
        time.sleep(0.5)
    return failed


def listing(benches: Sequence[Declared]) -> str:
    width = max(len(b.name) for b in benches)
    lines = [f"{b.name:{width}}  {','.join(b.tags):22}  {b.summary}" for b in benches]
    return "\n".join(lines + ["", "tags: " + "; ".join(f"{t}: {what}" for t, what in TAGS.items())])


def main(argv: Sequence[str] | None = None) -> int:
    args, passed = parse_args(sys.argv[1:] if argv is None else argv)
    benches = declared_benches()
    if args.list:
        print(listing(benches))
        return 0
    try:
        selected = chosen(args, benches)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    failed = run_benches(selected, passed)
    print(f"\n{len(selected)} benchmark(s) in {time.monotonic() - started:.0f} s", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
