#!/usr/bin/env python3
"""A/B of the HTTP front in one run: another checkout's coordinator (e.g. main) against this one, alternated.

Runs the benchmarks whose figures the front decides, each side in turn, and reports this side's figure over the other
side's for each (issue 31, item 2: the front's HTTP parsing moved to h11 and off asyncio's private attributes; the
slow-client, smuggling and transport figures must stay at least as good):

- ``bench.hostile --only slow_clients bad_inputs new_surface`` with ``--server-root``: an honest client's /health and
  5 MB push p99 under 1,000 slow connections (plain and TLS), the coordinator's peak RSS growth meanwhile, and the
  smuggling / framing / bad-input matrices (5xx and unexpected answers must stay 0);
- ``bench.front --server-root``: CPU and context switches per 4.7 MB push through the front alone;
- ``bench.transport`` with ``FEDMOE_BENCH_SERVER_ROOT``: a 1 GiB pull's and push's speed over a raw socket copy's.

    python -m bench.front_ab --baseline /tmp/main-checkout              # a few tens of minutes on 2 busy cores
    python -m bench.front_ab --baseline /tmp/main-checkout --quick      # smoke test

Table on stdout, results (with both commits, stamped with the load average) in bench/results/front_ab.json.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import ROOT, format_table
from bench.harness import Bench, Run, git_head
from protocol.cli import option

log = logging.getLogger("bench.front_ab")
SIDES = ("baseline", "change")


def run_bench(module: str, args: Sequence[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """``python -m module args --out TMP`` from this checkout; its result JSON."""
    with tempfile.TemporaryDirectory(prefix="fedmoe-front-ab-") as tmp:
        out = Path(tmp) / "out.json"
        done = subprocess.run([sys.executable, "-m", module, *args, "--out", str(out)], cwd=ROOT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{module} {' '.join(args)} failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def hostile_figures(root: Path, quick: bool) -> dict[str, float]:
    report = run_bench("bench.hostile", ["--only", "slow_clients", "bad_inputs", "new_surface", "--server-root",
                                         str(root), *(["--quick"] if quick else [])])
    figures: dict[str, float] = {"status_5xx": report["status_5xx"]}
    for mode, part in report["slow_clients"].items():
        loaded = part["under_attack"]
        figures |= {f"{mode} health p99 s": loaded["health"]["p99_s"], f"{mode} push p99 s": loaded["push_5mb"]["p99_s"],
                    f"{mode} peak RSS +MiB": part["peak_rss_growth_mb"], f"{mode} no answer": loaded["no_answer"]}
    figures["bad inputs unexpected"] = len(report["bad_inputs"]["unexpected"])
    for tag, part in report["new_surface"].items():
        figures[f"{tag} smuggling/surface unexpected"] = len(part["matrix"]["unexpected"])
        figures[f"{tag} surface 5xx"] = part["matrix"]["status_5xx"]
    return figures


def transport_figures(root: Path, quick: bool) -> dict[str, float]:
    report = run_bench("bench.transport", ["--quick"] if quick else ["--repeats", "2"],
                       env={"FEDMOE_BENCH_SERVER_ROOT": str(root)})
    return {k: report[k] for k in ("pull_vs_socket", "push_vs_socket", "rss_growth_per_model_size") if k in report}


def front_figures(baseline: Path, quick: bool) -> dict[str, dict[str, float]]:
    """bench.front alternates the two fronts itself: {side: its means}."""
    args = ["--server-root", str(baseline)] + (["--connections", "8", "--requests", "2", "--runs", "1"] if quick else [])
    means = run_bench("bench.front", args)["means"]
    return {"change": means[str(ROOT)], "baseline": means[str(baseline)]}


def alternate(baseline: Path, pairs: int, measure: Callable[[Path], dict[str, float]]) -> dict[str, list]:
    """``measure`` of each side, baseline first in every pair."""
    runs: dict[str, list] = {side: [] for side in SIDES}
    for pair in range(pairs):
        for side, root in zip(SIDES, (baseline, ROOT)):
            runs[side].append(measure(root) | {"load_average": round(os.getloadavg()[0], 2)})
            log.info("%s pair %d %s: %s", measure.__name__, pair + 1, side, runs[side][-1])
    return runs


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs if r.get(k) is not None) for k in runs[0]
            if any(r.get(k) is not None for r in runs)}


def ratios(change: dict[str, float], baseline: dict[str, float]) -> dict[str, float | None]:
    return {k: (round(change[k] / baseline[k], 3) if baseline.get(k) else None) for k in change if k in baseline}


@dataclass(frozen=True)
class Settings:
    baseline: Path | None = option(None, "the other checkout (its run_coordinator.py runs; required)", type=Path)
    baseline_commit: str | None = option(None, "the baseline's commit, for a checkout that is no git work tree (e.g. "
                                               "a `git archive` copy)")
    change_commit: str | None = option(None, "the same for this checkout")
    pairs: int = option(1, "baseline/change pairs of the hostile and transport runs")

    def __post_init__(self) -> None:
        if self.pairs < 1:
            raise ValueError(f"--pairs must be at least 1, got {self.pairs}")
        if self.baseline is not None and not (self.baseline / "run_coordinator.py").is_file():
            raise ValueError(f"--baseline {self.baseline}: no run_coordinator.py there")


def run(s: Settings, ctx: Run) -> int:
    if s.baseline is None:
        print("error: --baseline is required: the checkout to compare this one with", file=sys.stderr)
        return 2
    baseline = s.baseline.resolve()

    def hostile(root: Path) -> dict[str, float]:
        return hostile_figures(root, ctx.quick)

    def transport(root: Path) -> dict[str, float]:
        return transport_figures(root, ctx.quick)

    report: dict[str, Any] = {"commits": {"baseline": s.baseline_commit or git_head(baseline),
                                          "change": s.change_commit or git_head(ROOT)},
                              "roots": {"baseline": str(baseline), "change": str(ROOT)}}
    for name, measure in (("hostile", hostile), ("transport", transport)):
        runs = alternate(baseline, s.pairs, measure)
        report[name] = {"runs": runs, "figures": {side: medians(runs[side]) for side in SIDES}}
    report["front"] = {"figures": front_figures(baseline, ctx.quick)}
    for name in ("hostile", "transport", "front"):
        figures = report[name]["figures"]
        report[name]["change_over_baseline"] = ratios(figures["change"], figures["baseline"])
    ctx.write(report)
    print(format_table(["figure", f"baseline {report['commits']['baseline']}", f"change {report['commits']['change']}",
                        "change / baseline"], table_rows(report)))
    return 0


def table_rows(report: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for name in ("hostile", "transport", "front"):
        figures = report[name]["figures"]
        rows += [[f"{name}: {k}", figures["baseline"][k], figures["change"][k], ratio]
                 for k, ratio in report[name]["change_over_baseline"].items()]
    return rows


BENCH = Bench("front_ab", tags=("a-b", "http"), settings=Settings, run=run, torch_threads=None)
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
