#!/usr/bin/env python3
"""Federated vs central: tune each arm's settings on the *validation* split, at equal compute.

Issue 15's target: one specialty's data split over 3 workers reaches, in the same total compute
(optimiser steps), held-out loss within 2% of one worker training on all of it. A fair comparison
tunes both arms: the mean of three workers' deltas is less noisy than one worker's (a larger batch),
so the federated arm may want another worker learning rate than the central one, and another split of
its steps into rounds. This sweep trains each arm once per seed and scores it on the pandas domain's
validation split (carved from train/ by whole problem families; bench/realdata.py). It never scores the
held-out split: the chosen settings are then confirmed there by ``bench.quality_compression --fvc-only
--lr ... --central-lr ...`` over 3 seeds.

An arm is ``central:lr=2e-3`` (one worker, all the data, ``--total-steps`` steps) or
``fed:lr=2e-3,rounds=4,steps=2,server_lr=1,fresh_adam=0`` (3 workers on a third each, FedBuff rounds as
bench/fedrounds.py runs them; rounds x steps x workers must equal ``--total-steps``; ``fresh_adam=1``
restarts each worker's AdamW moments every round, which the product does not do). Omitted keys take
the suite's defaults (lr: the preset's recommended one; 4 rounds x 2 steps; server lr 1; moments kept).

    python -m bench.fvc_sweep --arms central:lr=5e-4 central:lr=1e-3 fed:lr=1e-3 fed:lr=2e-3 \\
        --out bench/results/quality_fvc_sweep_lr.json
    python -m bench.fvc_sweep --arms ... --estimate   # planned steps and scored problems, no model
"""
from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS_DIR, configure_logging, format_table, require_positive, write_json_atomic
from bench.fedrounds import FedJob, run_central, run_fed
from bench.realdata import (REAL_MODEL, SMOKE_MODEL, Lab, add_estimate_flags, ds1000_domains, loss_pair, pct,
                            planned_cost, quiet_estimate, render_plan, shards)

log = logging.getLogger("bench.fvc_sweep")
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

DOMAIN = "pandas_expert"
WORKERS = 3
TOTAL_STEPS = 24
"""The suite's equal-compute budget: 3 workers x 4 rounds x 2 steps (bench.quality_compression)."""
VALIDATION_PROBLEMS = 33
"""pandas_expert's validation split (for --estimate, which builds no split)."""


@dataclass(frozen=True)
class Arm:
    kind: str
    """'central' or 'fed'."""
    lr: float | None = None
    """AdamW learning rate of every worker (None: the preset's recommended one)."""
    rounds: int = 4
    steps: int = 2
    """fed: AdamW steps per worker per round."""
    server_lr: float = 1.0
    fresh_adam: int = 0
    """fed: 1 = every worker starts each round with fresh AdamW moments (the product keeps them)."""

    @property
    def label(self) -> str:
        lr = f"lr {self.lr:g}" if self.lr else "lr preset"
        if self.kind == "central":
            return f"central {lr}"
        return f"fed {self.rounds}x{self.steps} {lr} slr {self.server_lr:g}" + (" fresh adam" if self.fresh_adam else "")


def parse_arm(spec: str, total_steps: int, workers: int) -> Arm:
    """``central:lr=1e-3`` or ``fed:lr=2e-3,rounds=4,steps=2,server_lr=1``; a readable ValueError otherwise."""
    kind, _, rest = spec.partition(":")
    if kind not in ("central", "fed"):
        raise ValueError(f"arm {spec!r}: must start with 'central' or 'fed'")
    values: dict[str, Any] = {}
    allowed: dict[str, type] = {"lr": float} if kind == "central" else {
        "lr": float, "rounds": int, "steps": int, "server_lr": float, "fresh_adam": int}
    for item in filter(None, rest.split(",")):
        key, eq, raw = item.partition("=")
        if not eq or key not in allowed:
            raise ValueError(f"arm {spec!r}: {item!r} is not one of {', '.join(f'{k}=...' for k in allowed)}")
        expected = "0 or 1" if key == "fresh_adam" else "an integer" if allowed[key] is int else "a number"
        try:
            value = allowed[key](raw)
        except ValueError:
            raise ValueError(f"arm {spec!r}: {key} must be {expected}, got {raw!r}") from None
        if key == "fresh_adam" and value not in (0, 1):
            raise ValueError(f"arm {spec!r}: {key} must be {expected}, got {raw!r}")
        if key != "fresh_adam" and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"arm {spec!r}: {key} must be positive, got {raw!r}")
        values[key] = value
    arm = Arm(kind, **values)
    if kind == "fed" and arm.rounds * arm.steps * workers != total_steps:
        raise ValueError(f"arm {spec!r}: {arm.rounds} rounds x {arm.steps} steps x {workers} workers = "
                         f"{arm.rounds * arm.steps * workers} steps, not the {total_steps} of --total-steps")
    return arm


def run_arm(lab: Lab, arm: Arm, train: Sequence, validation: Sequence, seed: int, total_steps: int,
            workers: int) -> dict[str, Any]:
    """Train ``arm`` with ``seed``; its loss on the validation problems."""
    if arm.kind == "central":
        result = run_central(lab, train, total_steps, seed, lr=arm.lr)
    else:
        job = FedJob(tuple(tuple(x) for x in shards(train, workers)), arm.rounds, arm.steps, seed=seed,
                     server_lr=arm.server_lr, lr=arm.lr, fresh_optimizer=bool(arm.fresh_adam))
        result = run_fed(lab, job)
    return {"arm": asdict(arm), "label": arm.label, "seed": seed,
            **loss_pair(lab.losses(validation, result.weights, result.lora))}


def summarize(records: Sequence[dict[str, Any]], base: dict[str, float]) -> dict[str, Any]:
    """Per arm: mean validation loss over seeds and its gap to the best central arm."""
    arms: dict[str, dict[str, Any]] = {}
    for label in dict.fromkeys(r["label"] for r in records):
        group = [r for r in records if r["label"] == label]
        arms[label] = {"kind": group[0]["arm"]["kind"], "loss": statistics.fmean(r["loss"] for r in group),
                       "loss_without_end": statistics.fmean(r["loss_without_end"] for r in group),
                       "seeds": [r["seed"] for r in group]}
    central = {k: v for k, v in arms.items() if v["kind"] == "central"}
    best_central = min(central, key=lambda k: central[k]["loss"]) if central else None
    if best_central:
        for v in arms.values():
            v["vs_best_central_pct"] = pct(v["loss"], central[best_central]["loss"])
    fed = {k: v for k, v in arms.items() if v["kind"] == "fed"}
    return {"base_validation": base, "arms": arms, "best_central": best_central,
            "best_fed": min(fed, key=lambda k: fed[k]["loss"]) if fed else None}


def render(report: dict[str, Any]) -> str:
    summary = report["summary"]
    rows = [[label, f"{v['loss']:.4f}", f"{v['loss_without_end']:.4f}",
             f"{v['vs_best_central_pct']:+.2f}%" if "vs_best_central_pct" in v else "-", len(v["seeds"])]
            for label, v in sorted(summary["arms"].items(), key=lambda kv: kv[1]["loss"])]
    base = summary["base_validation"]
    return "\n".join([
        format_table(["arm", "validation loss", "w/o end", "vs best central", "seeds"], rows, align="lrrrr"),
        f"base model on validation: {base['loss']:.4f} (w/o end {base['loss_without_end']:.4f}); "
        f"best central: {summary['best_central']}; best federated: {summary['best_fed']}"])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", nargs="+", required=True, metavar="ARM",
                   help="central:lr=X or fed:lr=X,rounds=R,steps=S,server_lr=L (omitted keys: the defaults)")
    p.add_argument("--seeds", type=int, default=1, help="training seeds per arm, 0..N-1 (default: %(default)s)")
    p.add_argument("--total-steps", type=int, default=TOTAL_STEPS,
                   help="optimiser steps of every arm (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="tiny-qwen2 smoke run on 8 validation problems")
    add_estimate_flags(p)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "quality_fvc_sweep.json",
                   help="results JSON (default: %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true", help="library logs too")
    args = p.parse_args(argv)
    require_positive(p, args, "seeds", "total_steps")
    try:
        args.parsed_arms = [parse_arm(spec, args.total_steps, WORKERS) for spec in args.arms]
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.verbose)
    torch.set_num_threads(1)
    started = time.perf_counter()
    arms: list[Arm] = args.parsed_arms
    scored = 8 if args.quick else VALIDATION_PROBLEMS
    if args.estimate:
        plan = planned_cost(len(arms) * args.seeds * args.total_steps, scored * (1 + len(arms) * args.seeds),
                            args.priced_from or args.out)
        print(render_plan("bench.fvc_sweep", plan))
        return 0
    domain = next(d for d in ds1000_domains() if d.name == DOMAIN)
    validation = domain.validation[:scored]
    lab = Lab(SMOKE_MODEL if args.quick else REAL_MODEL)
    base = loss_pair(lab.losses(validation))
    records = []
    for i, (arm, seed) in enumerate([(a, s) for a in arms for s in range(args.seeds)], start=1):
        records.append(run_arm(lab, arm, domain.train, validation, seed, args.total_steps, WORKERS))
        log.info("[%d/%d] %s seed %d: validation %.4f", i, len(arms) * args.seeds, arm.label, seed,
                 records[-1]["loss"])
    report = {"benchmark": "fvc_sweep", "base_model": lab.model_id, "domain": DOMAIN, "split": "validation",
              "validation_problems": len(validation), "workers": WORKERS, "total_steps": args.total_steps,
              "records": records, "summary": summarize(records, base),
              "cost": quiet_estimate(lab.compute, time.perf_counter() - started)}
    write_json_atomic(args.out, report)
    print(render(report))
    log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
