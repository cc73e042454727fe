#!/usr/bin/env python3
"""Poisoning on a real model: one worker in five sends a poisoned update; does a robust rule hold?

smollm2-135m on DS-1000 pandas, synchronous rounds (bench/fedrounds.py: real trainer, the
coordinator's own FedBuff and ``--robust`` rules). Four honest workers each train on their own
quarter of the training problems; the fifth (20%) sends worker 0's honest delta times -4
(``sign_flip``) or times 10 (``scale``), i.e. an attacker that knows what an honest update looks
like. The reference is the four honest workers alone with plain averaging; the score is the
held-out loss relative to it (with and without the end-of-answer token), per training seed.
Target: with a defence on, <= 2% worse than honest-only.

    python -m bench.quality_poisoning            # smollm2-135m (make smollm2)
    python -m bench.quality_poisoning --quick    # tiny-qwen2 smoke run
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS_DIR, configure_logging, format_table, require_positive, write_json_atomic
from bench.fedrounds import ATTACKS, FedJob, run_fed
from bench.realdata import (REAL_MODEL, SMOKE_MODEL, Lab, add_estimate_flags, ds1000_domains, heldout_size, loss_pair,
                            pct, planned_cost, quiet_estimate, render_plan, shards, spread)
from coordinator.choices import ROBUST_NAMES

log = logging.getLogger("bench.quality_poisoning")
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

DOMAIN = "pandas_expert"
TARGET_PCT = 2.0


@dataclass(frozen=True)
class Settings:
    model: str = REAL_MODEL
    honest: int = 4
    """Honest workers; one attacker joins them (20% of five)."""
    rounds: int = 3
    steps: int = 1
    """AdamW steps per worker per round (batch 4 x <= 128 tokens)."""
    seeds: int = 3
    defences: tuple[str, ...] = ("median",)
    """Coordinator --robust rules tried against each attack (plain averaging runs once, for contrast)."""


QUICK = Settings(model=SMOKE_MODEL, rounds=2, seeds=1, defences=("median",))


def plan(s: Settings) -> list[tuple[str | None, str, int]]:
    """(attack, robust rule, seed) per job: honest-only and every defence on every seed; no defence on seed 0."""
    jobs: list[tuple[str | None, str, int]] = [(None, "none", seed) for seed in range(s.seeds)]
    for attack in ATTACKS:
        jobs.append((attack, "none", 0))
        jobs += [(attack, rule, seed) for rule in s.defences for seed in range(s.seeds)]
    return jobs


def estimate(s: Settings, measured: Path) -> dict[str, Any]:
    """Optimiser steps (the attacker trains none) and scored problems of the plan, priced from ``measured``."""
    jobs, heldout = len(plan(s)), heldout_size(DOMAIN)
    return planned_cost(jobs * s.rounds * s.steps * s.honest, heldout * (jobs + 1), measured)


def summarize(records: Sequence[Mapping[str, Any]], s: Settings) -> dict[str, Any]:
    honest = {r["seed"]: r for r in records if r["attack"] is None}
    out: dict[str, Any] = {}
    for r in records:
        if r["attack"] is None:
            continue
        ref = honest[r["seed"]]
        entry = out.setdefault(r["robust"], {}).setdefault(r["attack"], {"pct": [], "pct_without_end": []})
        entry["pct"].append(pct(r["loss"], ref["loss"]))
        entry["pct_without_end"].append(pct(r["loss_without_end"], ref["loss_without_end"]))
    summary = {rule: {attack: {"pct": spread(v["pct"]), "pct_without_end": spread(v["pct_without_end"])}
                      for attack, v in attacks.items()} for rule, attacks in out.items()}
    targets = {rule: {"met": all(a["pct"]["max"] <= TARGET_PCT for a in attacks.values()),
                      **{attack: a["pct"]["mean"] for attack, a in attacks.items()}}
               for rule, attacks in summary.items() if rule != "none"}
    return {"honest": {"loss": spread([r["loss"] for r in honest.values()]),
                       "loss_without_end": spread([r["loss_without_end"] for r in honest.values()])},
            "by_rule": summary, "targets": targets,
            "met_by": [rule for rule, t in targets.items() if t["met"]]}


def render(report: Mapping[str, Any]) -> str:
    rows = []
    for rule, attacks in report["summary"]["by_rule"].items():
        for attack, a in attacks.items():
            p = a["pct"]
            rows.append([attack, rule, f"{p['mean']:+.2f}", f"{p['min']:+.2f}..{p['max']:+.2f}", p["n"],
                         f"{a['pct_without_end']['mean']:+.2f}", "yes" if p["max"] <= TARGET_PCT else "NO"])
    honest = report["summary"]["honest"]["loss"]
    return (format_table(["attack", "aggregation", "vs honest %", "seeds range", "seeds", "w/o end %", "within 2%"],
                         rows, align="llrrrrl")
            + f"\n\nhonest-only held-out loss {honest['mean']:.4f} +/- {honest['std']:.4f}; base "
              f"{report['base']['loss']:.4f}; defences meeting the target on every seed: "
              f"{', '.join(report['summary']['met_by']) or 'none'}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny-qwen2 smoke run: 2 rounds, 1 seed, median only")
    p.add_argument("--rounds", type=int, default=None, help=f"rounds per job (default: {Settings.rounds})")
    p.add_argument("--seeds", type=int, default=None, help=f"training seeds (default: {Settings.seeds})")
    p.add_argument("--defences", nargs="+", choices=ROBUST_NAMES, default=None, metavar="RULE",
                   help=f"--robust rules tried against each attack, of {', '.join(ROBUST_NAMES)} "
                        f"(default: {' '.join(Settings.defences)})")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "quality_poisoning.json",
                   help="results JSON (default: %(default)s)")
    add_estimate_flags(p)
    p.add_argument("-v", "--verbose", action="store_true", help="library logs too")
    args = p.parse_args(argv)
    require_positive(p, args, "rounds", "seeds")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.verbose)
    torch.set_num_threads(1)
    started = time.perf_counter()
    s = QUICK if args.quick else Settings()
    overrides = {"rounds": args.rounds, "seeds": args.seeds,
                 "defences": tuple(dict.fromkeys(args.defences)) if args.defences else None}
    s = dataclasses.replace(s, **{k: v for k, v in overrides.items() if v is not None})
    if args.estimate:
        measured = args.priced_from or (args.out if args.out.is_file() else RESULTS_DIR / "quality_compression.json")
        print(render_plan("bench.quality_poisoning", estimate(s, measured)))
        return 0
    domain = next(d for d in ds1000_domains() if d.name == DOMAIN)
    lab = Lab(s.model)
    worker_data = tuple(tuple(x) for x in shards(domain.train, s.honest))
    jobs = plan(s)
    records = []
    for i, (attack, robust, seed) in enumerate(jobs, start=1):
        result = run_fed(lab, FedJob(worker_data, s.rounds, s.steps, seed=seed, robust=robust, attack=attack))
        records.append({"attack": attack, "robust": robust, "seed": seed,
                        **loss_pair(lab.losses(domain.heldout, result.weights, result.lora))})
        log.info("[%d/%d] %s / %s seed %d: held-out %.4f", i, len(jobs), attack or "honest only", robust, seed,
                 records[-1]["loss"])
    report = {"benchmark": "quality_poisoning", "base_model": s.model, "domain": DOMAIN, "quick": args.quick,
              "settings": asdict(s), "target_pct": TARGET_PCT, "base": loss_pair(lab.losses(domain.heldout)),
              "records": records, "summary": summarize(records, s),
              "cost": quiet_estimate(lab.compute, time.perf_counter() - started)}
    write_json_atomic(args.out, report)
    print(render(report))
    log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
