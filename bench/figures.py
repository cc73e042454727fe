"""The current figure of every benchmark, from its result file: the table docs/benchmarks.md shows.

    python -m bench.figures            # print the table
    python -m bench.figures --write    # put it into docs/benchmarks.md (between its figures markers)

One row per result file in bench/results/ (earlier runs live in bench/results/history/): the bench, its headline
figures, and the commit, date and machine load it was measured at. A result written by the harness carries them
in its ``stamp``; for a file from before the harness the commit and date are those of the commit that recorded
the file (git log), marked "recorded", and the load is what the file itself noted, if anything.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, ROOT

DOC = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- figures:start (python -m bench.figures --write) -->", "<!-- figures:end -->"
Report = dict[str, Any]


def _pct(x: float) -> str:
    return f"{x:+.1f}%"


def _met(target: dict[str, Any]) -> str:
    return "met" if target.get("met") else "NOT met"


def _attack_aucs(r: Report) -> str:
    """bench.privacy's headline: the loss attack's AUC against what each arm's attacker holds."""
    return "membership-inference AUC (loss attack): " + ", ".join(
        f"{arm} {a['attack']['loss']['auc']:.2f}" for arm, a in r["arms"].items() if "attack" in a)


HEADLINES: dict[str, Callable[[Report], str]] = {
    "adaptive": lambda r: (f"auto {r['summary']['verdict']['auto_mean']:.4f} vs the best rival "
                           f"{r['summary']['verdict']['best_mean']:.4f} ({r['summary']['verdict']['best']}; "
                           "held-out loss)"),
    "aggregation": lambda r: f"slowest rule {r['gbps']:.1f} GB/s on one core (target >= {r['target_gbps']:g})",
    "byzantine": lambda r: "sign_flip x4 / scale x10 vs honest-only: " + ", ".join(
        f"{rule} {_pct(t['sign_flip'])} / {_pct(t['scale'])}" for rule, t in r["targets"].items()),
    "compression": lambda r: (f"best ratio within 1% of fp32: {r['best_ratio_within_1pct']:.0f}x "
                              f"({r['best_within_1pct']['label']}); targets " + ", ".join(
                                  f"{k}: {_met(v)}" for k, v in r["targets"].items())),
    "converge": lambda r: "final held-out loss at equal steps: " + ", ".join(
        f"{s['arm']} x{s['workers']} {s['final']:.4f}" for s in r["summary"]) + f" (base {r['base_loss']:.4f})",
    "crash": lambda r: (f"{r['kills']} kill -9: {r['pushes_acknowledged']} pushes acknowledged, "
                        f"{len(r['problems'])} problems, restart p50 {r['restart_s']['p50']:.2f} s"),
    "front": lambda r: "this front over the other: " + ", ".join(
        f"{k} {v:g}" for k, v in r.get("ratios_this_over_other", {}).items()),
    "gateway": lambda r: (f"mean retained gain: exact average {r['mean_retained_gain']['exact_average']:.3f}, "
                          f"naive {r['mean_retained_gain']['naive_factor_average']:.3f}, router "
                          f"{r['mean_retained_gain']['router']:.3f} (tiny-qwen2)"),
    "gateway_growth": lambda r: (f"{r['steady_growth_bytes_per_min'] / 1e6:.2f} MB/min steady data-dir growth over "
                                 f"{r['minutes']:g} min of pushes and gateway polls"),
    "hostile": lambda r: (f"{r['requests_tried']} hostile requests, {r['status_5xx']} 5xx; a normal client's worst "
                          f"p99 under attack {r['normal_client_p99_s']} s (target < 1 s)"),
    "learning": lambda r: f"{r['base_model']}: " + ", ".join(
        f"{x['option']} {x['heldout_after']:.3f} ({x['speed_vs_fp32']:.2f}x speed)" for x in r["records"]),
    "load": lambda r: (f"{r['pushes']} pushes of {r['body_bytes_per_update'] / 1e6:.1f} MB: {r['lost']} lost, "
                       f"{r['duplicated']} duplicated, {r['pushes_per_s']} pushes/s, p99 {r['latency_s']['p99']} s, "
                       f"peak RSS {r['coordinator_peak_rss_mb']['max_process']} MB"),
    "merge_speed": lambda r: (f"worst merge / dense floor {r['worst_merge_floor_ratio']:.2f}x (target <= 3x: "
                              f"{'met' if r['target_met'] else 'NOT met'})"),
    "overhead": lambda r: (f"sync overhead {r['sync_overhead_pct']:+.1f}% tokens/s (target <= 2%: "
                           f"{_met(r['target'])})"),
    "quality_compression": lambda r: (f"smollm2-135m: {r['summary']['best_ratio_within_1pct']:.0f}x within 1% of "
                                      "fp32 held-out loss; " + ", ".join(
                                          f"{k}: {_met(v)}" for k, v in r["summary"]["targets"].items())),
    "quality_gateway": lambda r: "; ".join(f"{t['target']}: {t['detail']} ({_met(t)})" for t in r["targets"]),
    "quality_poisoning": lambda r: "smollm2-135m, one attacker in five: " + ", ".join(
        f"{rule}: sign_flip {_pct(t['sign_flip'])}, scale {_pct(t['scale'])} ({_met(t)})"
        for rule, t in r["summary"]["targets"].items()),
    "relay_crash": lambda r: (f"{r['kills']} relay kills: {r['samples_acknowledged']} samples acknowledged, "
                              f"{r['root_samples_seen']} seen at the root"),
    "resume": lambda r: "a break at 90%: " + ", ".join(
        f"{x['mode']} re-sends {x['resent_mib']} MiB" for x in r["rows"] if x["broken"]),
    "router_calibration": lambda r: (f"fitted threshold {r['fitted_threshold']}: held-out top-1 "
                                     f"{r['heldout_top1_accuracy']:.3f}"),
    "scale": lambda r: (f"2 replicas / 1: {r['two_vs_one_replica_pushes_per_s']}x pushes/s; "
                        f"{r['crashes']['rounds']} kill -9 rounds: {r['crashes']['lost']} lost, "
                        f"{r['crashes']['applied_twice']} applied twice"),
    "scaling": lambda r: "aggregate tokens/s vs 1 worker: " + ", ".join(
        f"{x['name']} {x['speedup_vs_1_worker']:.2f}x" for x in r["records"]),
    "serve": lambda r: "tokens/s: " + ", ".join(f"{k} {v['tokens_per_s']:g}" for k, v in r["streams"].items()),
    "strategies": lambda r: "2-rank scaling efficiency: " + ", ".join(
        f"{c['config']} {c['scaling_efficiency']:.2f}" for c in r["configs"]),
    "sync_cost": lambda r: "CPU per sync, legacy / current: " + ", ".join(
        f"{k} {v:g}x" for k, v in r["ratios"].items()),
    "transport": lambda r: (f"1 GiB: pull {r['pull_vs_socket']:.2f} and push {r['push_vs_socket']:.2f} of a raw "
                            f"socket (target >= 0.5)"),
    "default_compression_quick": lambda r: f"{r['base_model']}: " + ", ".join(
        f"{a['arm']} {a['bytes_per_sync_ratio']:.2f}x fewer bytes per sync, loss {_pct(a['loss_change_pct'])}"
        for a in r["arms"][1:]),
    "worker_memory_smollm2": lambda r: "peak RSS MB: " + ", ".join(
        f"{x['model']} {x['config']} {x['peak_rss_mb']:.0f}" for x in r["rows"]),
    "worker_memory_tiny": lambda r: "peak RSS MB: " + ", ".join(
        f"{x['config']} {x['peak_rss_mb']:.0f}" for x in r["rows"] if x["config"] in ("before", "after")),
    "front_ab": lambda r: f"change / baseline {r['commits']['baseline']}: " + ", ".join(
        f"{k} {r[part]['change_over_baseline'][k]:g}" for part, k in (
            ("hostile", "tls health p99 s"), ("hostile", "tls push p99 s"), ("hostile", "plain push p99 s"),
            ("transport", "pull_vs_socket"), ("transport", "push_vs_socket"), ("front", "requests_per_s"))),
    "privacy_tiny_qwen2": lambda r: _attack_aucs(r),
    "privacy": lambda r: "smollm2-135m, " + _attack_aucs(r),
    "secagg": lambda r: "; ".join(
        f"{x['model']}: masked upload x{x['arms']['masked']['bytes_up_per_worker'] / x['arms']['plain']['bytes_up_per_worker']:.4f}"
        f" of plain, sum error {x['arms']['masked']['max_error']:.1e}" for x in r["results"]),
    "secagg_quality": lambda r: (f"held-out loss plain {r['arms']['plain']['heldout']['loss']:.4f}, secagg "
                                 f"{r['arms']['secagg']['heldout']['loss']:.4f} ({r['model']})"),
    "transport_ab": lambda r: "change / baseline: " + ", ".join(f"{k} {v:g}" for k, v in r["ratios"].items()),
    "wan": lambda r: "to 90% of the best baseline's gain, vs it (steps per worker): " + ", ".join(
        f"{x['mode']} " + (f"{x['speedup_target90_s']:g}x ({x['steps_to_target90']['median']:g})"
                           if x["speedup_target90_s"] else "never") for x in r["summary"]),
    "wan_link": lambda r: ", ".join(
        f"{name} {p['download_mbit_s']:.0f}/{p['configured_mbit_s']:g} Mbit/s, RTT {p['rtt_ms_median']:.1f}/"
        f"{p['configured_rtt_ms']:g} ms" for name, p in r.items() if isinstance(p, dict)),
}
"""Headline figures per result file (by stem): what the row of docs/benchmarks.md says."""
BENCH_OF = {"router_calibration": "quality_gateway --router-only", "wan_link": "wanemu.measure",
            "privacy_tiny_qwen2": "privacy --model tiny-qwen2", "default_compression_quick": "default_compression --quick",
            "worker_memory_smollm2": "worker_memory --models smollm2-135m",
            "worker_memory_tiny": "worker_memory --models tiny-qwen2"}


def measured_at(path: Path, report: Report) -> tuple[str, str, str]:
    """(commit, date, load) of a result: its stamp, or for an older file the commit that recorded it."""
    stamp = report.get("stamp")
    if isinstance(stamp, dict):
        load = stamp["load_average"]["end"][0]
        return stamp["commit"] + (" (dirty)" if stamp["dirty"] else ""), stamp["date"][:10], f"{load:.1f}"
    log = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %cs", "--", str(path)],
                         capture_output=True, text=True).stdout.split()
    commit, date = (log + ["?", "?"])[:2]
    noted = (report.get("load_average_at_end") or report.get("load_average_end") or report.get("load_average")
             or report.get("load"))
    if isinstance(noted, dict):  # {"start": [...], "end": [...]}
        noted = noted.get("end")
    if isinstance(noted, list) and noted and isinstance(noted[0], (int, float)):
        noted = noted[0]
    load = f"{noted:.1f}" if isinstance(noted, (int, float)) else str(noted) if noted else "-"
    return f"{commit} (recorded)", date, load


def headline(stem: str, report: Report) -> str:
    """The row's figures; a result whose keys changed says so instead of breaking the table."""
    if stem not in HEADLINES:
        return "(no headline: add one to bench/figures.py)"
    try:
        return HEADLINES[stem](report)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        return f"(the headline does not fit this result: {type(exc).__name__} {exc})"


def rows(results: Path = RESULTS_DIR) -> list[list[str]]:
    out = []
    for path in sorted(results.glob("*.json")):
        report = json.loads(path.read_text())
        figure = headline(path.stem, report)
        commit, date, load = measured_at(path, report)
        out.append([f"`{BENCH_OF.get(path.stem, path.stem)}`", figure, commit, date, load,
                    f"[{path.name}](../bench/results/{path.name})"])
    return out


def table(results: Path = RESULTS_DIR) -> str:
    lines = ["| bench | current figures | commit | date | load | result |", "|---|---|---|---|---|---|"]
    return "\n".join(lines + ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |"
                              for row in rows(results)])


def write(doc: Path = DOC) -> None:
    text = doc.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"error: {doc} has no {START} ... {END} block to fill")
    head, rest = text.split(START, 1)
    doc.write_text(head + START + "\n" + table() + "\n" + END + rest.split(END, 1)[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.figures", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="fill docs/benchmarks.md's table instead of printing it")
    args = p.parse_args(argv)
    if args.write:
        write()
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
