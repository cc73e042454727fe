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

import logging
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


from bench.common import format_table
from bench.harness import Bench, Run
from protocol.cli import option
from bench.fedrounds import ATTACKS, FedJob, run_fed
from bench.realdata import (REAL_MODEL, SMOKE_MODEL, Estimate, Lab, ds1000_domains, heldout_size, loss_pair,
                            pct, planned_cost, quiet_estimate, render_plan, shards, spread)
from coordinator.choices import ROBUST_NAMES

log = logging.getLogger("bench.quality_poisoning")
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

DOMAIN = "pandas_expert"
TARGET_PCT = 2.0


@dataclass(frozen=True)
class Settings(Estimate):
    model: str = REAL_MODEL
    honest: int = 4
    """Honest workers; one attacker joins them (20% of five)."""
    rounds: int = option(3, "rounds per job")
    steps: int = 1
    """AdamW steps per worker per round (batch 4 x <= 128 tokens)."""
    seeds: int = option(3, "training seeds")
    defences: tuple[str, ...] = option(("median",), "--robust rules tried against each attack (plain averaging runs "
                                       "once, for contrast)", nargs="+", choices=ROBUST_NAMES, metavar="RULE")

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.seeds < 1:
            raise ValueError(f"--rounds and --seeds must be at least 1, got {self.rounds} and {self.seeds}")
        object.__setattr__(self, "defences", tuple(dict.fromkeys(self.defences)))  # each rule once


QUICK = {"model": SMOKE_MODEL, "rounds": 2, "seeds": 1, "defences": ("median",)}


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


def run(s: Settings, ctx: Run) -> int:
    if s.estimate:
        measured = s.priced_from or (ctx.out if ctx.out.is_file() else ctx.out.with_name("quality_compression.json"))
        print(render_plan("bench.quality_poisoning", estimate(s, measured)))
        return 0
    started = time.perf_counter()
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
    report = {"benchmark": "quality_poisoning", "base_model": s.model, "domain": DOMAIN, "quick": ctx.quick,
              "settings": asdict(s), "target_pct": TARGET_PCT, "base": loss_pair(lab.losses(domain.heldout)),
              "records": records, "summary": summarize(records, s),
              "cost": quiet_estimate(lab.compute, time.perf_counter() - started)}
    ctx.write(report)
    print(render(report))
    log.info("wrote %s", ctx.out)
    return 0


BENCH = Bench("quality_poisoning", tags=("quality",), settings=Settings, run=run, quick=QUICK, cores=1)
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
