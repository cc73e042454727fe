#!/usr/bin/env python3
"""Federated vs central: tune each arm's settings on the *validation* split, at equal compute.

Issue 15's target: one specialty's data split over 3 workers reaches, in the same total compute
(optimiser steps), held-out loss within 2% of one worker training on all of it. A fair comparison
tunes both arms: the mean of three workers' deltas is less noisy than one worker's (a larger batch),
so the federated arm may want another worker learning rate than the central one, and another split of
its steps into rounds. This sweep trains each arm once per seed and scores it on the pandas domain's
validation split (carved from train/ by whole problem families; bench/realdata.py). Without
``--heldout`` it never scores the held-out split: the chosen settings are then confirmed there, by
``--heldout`` below or by ``bench.quality_compression --fvc-only --lr ... --central-lr ...``, over 3 seeds.

Horizons and early stopping (``--horizons 24 48 72 --every 12``): each arm trains once per seed for the
longest horizon and scores validation every ``--every`` optimiser steps in all (the federated arm at the
round boundaries, where the three workers together have taken that many steps: equal total compute). For
each horizon H two checkpoints count: the one at H (fixed horizon) and the one with the lowest validation
loss at or before H (early stopping, chosen on validation only). ``--heldout`` then scores held-out at those
checkpoints only and compares the federated arm with the central one per horizon, each arm kind's lr picked
per horizon by its mean validation loss at the chosen checkpoint (bench/results/history/quality_fvc_horizon.json).
``--cache DIR`` keeps every run's checkpoints and validation losses in DIR (safetensors + JSON), so a
held-out run reuses the sweep's seed 0 instead of training it again (also when the sweep ran longer).

An arm is ``central:lr=2e-3`` (one worker, all the data, ``--total-steps`` steps) or
``fed:lr=2e-3,rounds=4,steps=2,server_lr=1,fresh_adam=0`` (3 workers on a third each, FedBuff rounds as
bench/fedrounds.py runs them; rounds x steps x workers must equal ``--total-steps``; ``fresh_adam=1``
restarts each worker's AdamW moments every round, which the product does not do). Omitted keys take
the suite's defaults (lr: the preset's recommended one; 4 rounds x 2 steps; server lr 1; moments kept).

    python -m bench.fvc_sweep --arms central:lr=5e-4 central:lr=1e-3 fed:lr=1e-3 fed:lr=2e-3 \\
        --out bench/results/history/quality_fvc_sweep_lr.json
    python -m bench.fvc_sweep --arms ... --estimate   # planned steps and scored problems, no model
    python -m bench.fvc_sweep --horizons 24 48 72 --every 12 --cache /tmp/fvc --arms central:lr=1e-3 \
        fed:lr=3e-3,steps=2 --seeds 3 --heldout --out bench/results/history/quality_fvc_horizon.json
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import math
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


from bench.common import format_table
from bench.harness import Bench, Run
from bench.fedrounds import FedJob, FedResult, run_central, run_fed
from bench.realdata import (REAL_MODEL, SMOKE_MODEL, Estimate, Lab, ds1000_domains, heldout_size, loss_pair,
                            pct, planned_cost, quiet_estimate, render_plan, shards, spread)
from protocol.cli import option
from protocol.files import write_atomically
from protocol.tensors import StateDict, dumps, loads

log = logging.getLogger("bench.fvc_sweep")
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

DOMAIN = "pandas_expert"
WORKERS = 3
TOTAL_STEPS = 24
"""The suite's equal-compute budget: 3 workers x 4 rounds x 2 steps (bench.quality_compression)."""
VALIDATION_PROBLEMS = 33
"""pandas_expert's validation split (for --estimate, which builds no split)."""
FED_VS_CENTRAL_PCT = 2.0
"""Issue 15's target: the federated arm's held-out loss within 2% of the central arm's."""


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
    per_round = values.get("steps", Arm.steps) * workers
    if kind == "fed" and "rounds" not in values and total_steps % per_round == 0:
        values["rounds"] = total_steps // per_round  # as many rounds as the budget holds
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


@dataclass
class Trajectory:
    """One arm trained with one seed: validation losses and weights at every checkpoint (total optimiser steps)."""

    validation: dict[int, dict[str, float]]
    weights: dict[int, StateDict]
    lora: dict[str, Any]
    cpu_seconds: float
    """Process CPU seconds of the training and validation scoring (when cached: of the run that made it)."""


def checkpoint_steps(arm: Arm, total_steps: int, every: int, workers: int) -> list[int]:
    """Total optimiser steps at which ``arm`` is scored: every ``every`` (a round boundary for federated arms)."""
    if every % (arm.steps * workers if arm.kind == "fed" else 1):
        raise ValueError(f"--every {every} is not a whole number of rounds of {arm.label} "
                         f"({arm.steps} steps x {workers} workers per round)")
    return list(range(every, total_steps + 1, every))


def train_checkpoints(lab: Lab, arm: Arm, train: Sequence, validation: Sequence, seed: int, total_steps: int,
                      every: int, workers: int) -> Trajectory:
    """Train ``arm`` once for ``total_steps`` in all; score validation every ``every`` steps in all."""
    started = time.process_time()
    steps = checkpoint_steps(arm, total_steps, every, workers)
    result: FedResult
    if arm.kind == "central":
        result = run_central(lab, train, total_steps, seed, snapshots=steps, lr=arm.lr)
    else:
        job = FedJob(tuple(tuple(x) for x in shards(train, workers)), arm.rounds, arm.steps, seed=seed,
                     server_lr=arm.server_lr, lr=arm.lr, fresh_optimizer=bool(arm.fresh_adam),
                     snapshot_every=every // (arm.steps * workers))
        result = run_fed(lab, job)
    weights = {n: result.snapshots[n] for n in steps}
    scores = {n: loss_pair(lab.losses(validation, weights[n], result.lora)) for n in steps}
    return Trajectory(scores, weights, dict(result.lora), time.process_time() - started)


def _cache_path(cache: Path, model: str, arm: Arm, seed: int, total_steps: int, every: int) -> Path:
    slug = re.sub(r"[^A-Za-z0-9.]+", "_", f"{model} {arm.label} seed {seed} steps {total_steps} every {every}")
    return cache / f"{slug}.safetensors"


def save_trajectory(path: Path, run: Trajectory) -> None:
    """Checkpoints as safetensors (never pickle) and their validation losses as JSON next to them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, dumps({f"{n}:{k}": t for n, w in run.weights.items() for k, t in w.items()}))
    meta = {"validation": {str(n): v for n, v in run.validation.items()}, "lora": run.lora, "cpu_seconds": run.cpu_seconds}
    write_atomically(path.with_suffix(".json"), json.dumps(meta).encode())


def find_cached(cache: Path, model: str, arm: Arm, seed: int, total_steps: int, every: int,
                workers: int) -> Trajectory | None:
    """The cached run of ``arm`` with ``seed`` and ``every`` that reached ``total_steps``, or a longer one cut
    to ``total_steps`` (its checkpoints up to there are the same weights: training is deterministic)."""
    per_round = arm.steps * workers if arm.kind == "fed" else 1
    for total in range(total_steps, 100 * total_steps + 1, every):
        longer = dataclasses.replace(arm, rounds=total // per_round) if arm.kind == "fed" else arm
        if total % per_round == 0 and _cache_path(cache, model, longer, seed, total, every).exists():
            run = load_trajectory(_cache_path(cache, model, longer, seed, total, every))
            if run is not None and all(n in run.validation for n in range(every, total_steps + 1, every)):
                keep = [n for n in run.validation if n <= total_steps]
                return Trajectory({n: run.validation[n] for n in keep}, {n: run.weights[n] for n in keep}, run.lora,
                                  run.cpu_seconds * total_steps / total)
    return None


def load_trajectory(path: Path) -> Trajectory | None:
    """A cached run, or None when there is none (or it is unreadable: then it is trained again)."""
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        tensors = loads(path.read_bytes())
        validation = {int(n): {"loss": float(v["loss"]), "loss_without_end": float(v["loss_without_end"])}
                      for n, v in meta["validation"].items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if path.exists():
            log.warning("ignoring the cached run %s: %s", path, exc)
        return None
    weights: dict[int, StateDict] = {n: {} for n in validation}
    for key, tensor in tensors.items():
        step, _, name = key.partition(":")
        if int(step) in weights:
            weights[int(step)][name] = tensor
    return Trajectory(validation, weights, meta["lora"], float(meta.get("cpu_seconds", 0.0)))


def pick(validation: dict[int, dict[str, float]], horizon: int) -> int:
    """The checkpoint at or before ``horizon`` with the lowest validation loss (the earliest on a tie)."""
    return min((n for n in validation if n <= horizon), key=lambda n: (validation[n]["loss"], n))


def horizon_record(lab: Lab, arm: Arm, seed: int, run: Trajectory, horizons: Sequence[int],
                   heldout: Sequence | None, cached: bool) -> dict[str, Any]:
    """Per horizon: the fixed and the validation-chosen checkpoint, and (``heldout``) their held-out losses."""
    per: dict[str, Any] = {}
    for h in horizons:
        chosen = pick(run.validation, h)
        per[str(h)] = {"chosen_step": chosen, "validation_fixed": run.validation[h]["loss"],
                       "validation_chosen": run.validation[chosen]["loss"]}
    if heldout is not None:
        needed = sorted({*horizons, *(v["chosen_step"] for v in per.values())})
        scored = {n: loss_pair(lab.losses(heldout, run.weights[n], run.lora)) for n in needed}
        for h in horizons:
            per[str(h)]["heldout_fixed"] = scored[h]
            per[str(h)]["heldout_chosen"] = scored[per[str(h)]["chosen_step"]]
    return {"arm": asdict(arm), "label": arm.label, "seed": seed, "cached": cached,
            "cpu_seconds": round(run.cpu_seconds, 1),
            "validation": {str(n): v for n, v in sorted(run.validation.items())}, "horizons": per}


def summarize_horizons(records: Sequence[dict[str, Any]], horizons: Sequence[int], base: dict[str, Any]) -> dict[str, Any]:
    """Per arm and horizon: mean validation losses (fixed, chosen); with held-out, federated vs central per horizon.

    For each horizon and mode (``fixed``: the checkpoint at the horizon; ``chosen``: the best validation
    checkpoint at or before it) each arm kind is represented by its label with the lowest mean validation
    loss in that mode (the lr tuned on validation), and the federated one's held-out loss is compared with the
    central one's: the gap of the means, the per-seed gaps (same seeds), the same without the end token.
    """
    labels = list(dict.fromkeys(r["label"] for r in records))
    arms: dict[str, Any] = {}
    for label in labels:
        group = [r for r in records if r["label"] == label]
        per = {}
        for h in map(str, horizons):
            entry: dict[str, Any] = {
                "validation_fixed": statistics.fmean(r["horizons"][h]["validation_fixed"] for r in group),
                "validation_chosen": statistics.fmean(r["horizons"][h]["validation_chosen"] for r in group),
                "chosen_steps": [r["horizons"][h]["chosen_step"] for r in group]}
            if "heldout_fixed" in group[0]["horizons"][h]:
                for mode in ("fixed", "chosen"):
                    entry[f"heldout_{mode}"] = spread([r["horizons"][h][f"heldout_{mode}"]["loss"] for r in group])
                    entry[f"heldout_{mode}_without_end"] = spread(
                        [r["horizons"][h][f"heldout_{mode}"]["loss_without_end"] for r in group])
            per[h] = entry
        arms[label] = {"kind": group[0]["arm"]["kind"], "seeds": [r["seed"] for r in group], "horizons": per}
    comparisons: dict[str, Any] = {}
    for h in map(str, horizons):
        for mode in ("fixed", "chosen"):
            best = {kind: min((label for label in labels if arms[label]["kind"] == kind),
                              key=lambda label: arms[label]["horizons"][h][f"validation_{mode}"], default=None)
                    for kind in ("central", "fed")}
            if best["central"] is None or best["fed"] is None:
                continue
            c, f = arms[best["central"]]["horizons"][h], arms[best["fed"]]["horizons"][h]
            out: dict[str, Any] = {"central": best["central"], "fed": best["fed"],
                                   "validation_gap_pct": pct(f[f"validation_{mode}"], c[f"validation_{mode}"]),
                                   "central_chosen_steps": c["chosen_steps"], "fed_chosen_steps": f["chosen_steps"]}
            if f"heldout_{mode}" in c and f"heldout_{mode}" in f:
                seeds = sorted(set(arms[best["central"]]["seeds"]) & set(arms[best["fed"]]["seeds"]))
                by_seed = {kind: {r["seed"]: r["horizons"][h][f"heldout_{mode}"] for r in records
                                  if r["label"] == best[kind]} for kind in ("central", "fed")}
                gap = pct(f[f"heldout_{mode}"]["mean"], c[f"heldout_{mode}"]["mean"])
                out.update({
                    "central_heldout": c[f"heldout_{mode}"], "fed_heldout": f[f"heldout_{mode}"], "gap_pct": gap,
                    "gap_pct_without_end": pct(f[f"heldout_{mode}_without_end"]["mean"],
                                               c[f"heldout_{mode}_without_end"]["mean"]),
                    "per_seed_gap_pct": {str(s): pct(by_seed["fed"][s]["loss"], by_seed["central"][s]["loss"])
                                         for s in seeds},
                    "met": gap <= FED_VS_CENTRAL_PCT})
            comparisons[f"{h} {mode}"] = out
    return {"base": base, "arms": arms, "comparisons": comparisons, "target_pct": FED_VS_CENTRAL_PCT}


def render_horizons(report: dict[str, Any]) -> str:
    summary = report["summary"]
    rows = []
    for label, a in summary["arms"].items():
        for h, v in a["horizons"].items():
            row = [label, h, f"{v['validation_fixed']:.4f}",
                   f"{v['validation_chosen']:.4f} @{','.join(map(str, v['chosen_steps']))}"]
            if "heldout_fixed" in v:
                row += [f"{v['heldout_fixed']['mean']:.4f} +/- {v['heldout_fixed']['std'] or 0:.4f}",
                        f"{v['heldout_chosen']['mean']:.4f} +/- {v['heldout_chosen']['std'] or 0:.4f}"]
            rows.append(row)
    held = any("heldout_fixed" in v for a in summary["arms"].values() for v in a["horizons"].values())
    header = ["arm", "horizon", "validation at horizon", "best validation @steps (per seed)"]
    header += ["held-out at horizon", "held-out at chosen"] if held else []
    lines = [format_table(header, rows, align="lr" + "r" * (len(header) - 2))]
    comp_rows = []
    for key, c in summary["comparisons"].items():
        row = [key, c["central"], c["fed"], f"{c['validation_gap_pct']:+.2f}%"]
        if "gap_pct" in c:
            row += [f"{c['gap_pct']:+.2f}%", " ".join(f"{g:+.1f}" for g in c["per_seed_gap_pct"].values()),
                    f"{c['gap_pct_without_end']:+.2f}%", "met" if c["met"] else "NOT met"]
        comp_rows.append(row)
    if comp_rows:
        header = ["horizon, checkpoint", "central", "federated", "validation gap"]
        header += ["held-out gap", "per seed %", "w/o end", f"within {summary['target_pct']:g}%"] if held else []
        lines += ["", format_table(header, comp_rows, align="l" * 3 + "r" * (len(header) - 3))]
    return "\n".join(lines)


def run_horizons(s: Settings, ctx: Run, arms: Sequence[Arm], started: float) -> int:
    """--horizons: one run per arm and seed, scored on validation every --every steps; --heldout at the picks."""
    assert s.horizons is not None and s.every is not None  # Settings fills --every whenever --horizons is given
    horizons, total, every = s.horizons, max(s.horizons), s.every
    scored = s.validation_problems
    checkpoints = total // every
    if s.estimate:
        n = len(arms) * s.seeds
        problems = s.heldout_limit or heldout_size(DOMAIN)
        at_most = problems * (1 + n * min(2 * len(horizons), checkpoints)) if s.heldout else 0
        plan = planned_cost(n * total, scored * (1 + n * checkpoints) + at_most, s.priced_from or ctx.out)
        print(render_plan("bench.fvc_sweep", plan) + (" (held-out: at most)" if s.heldout else "")
              + ("; cached runs are not trained again" if s.cache else ""))
        return 0
    domain = next(d for d in ds1000_domains() if d.name == DOMAIN)
    validation = domain.validation[:scored]
    heldout = domain.heldout[:s.heldout_limit] if s.heldout else None
    lab = Lab(s.model)
    base: dict[str, Any] = {"validation": loss_pair(lab.losses(validation))}
    if heldout is not None:
        base["heldout"] = loss_pair(lab.losses(heldout))
    records = []
    runs = [(a, seed) for a in arms for seed in range(s.seeds)]
    for i, (arm, seed) in enumerate(runs, start=1):
        path = _cache_path(s.cache, lab.model_id, arm, seed, total, every) if s.cache else None
        run = find_cached(s.cache, lab.model_id, arm, seed, total, every, WORKERS) if s.cache else None
        cached = run is not None
        if run is None:
            run = train_checkpoints(lab, arm, domain.train, validation, seed, total, every, WORKERS)
            if path:
                save_trajectory(path, run)
        records.append(horizon_record(lab, arm, seed, run, horizons, heldout, cached))
        log.info("[%d/%d] %s seed %d%s: validation %s", i, len(runs), arm.label, seed, " (cached)" if cached else "",
                 " ".join(f"{n}:{v['loss']:.4f}" for n, v in sorted(run.validation.items())))
    report = {"benchmark": "fvc_sweep", "mode": "horizons", "base_model": lab.model_id, "domain": DOMAIN,
              "split": "validation + held-out at the picks" if heldout is not None else "validation",
              "validation_problems": len(validation), "heldout_problems": len(heldout) if heldout is not None else 0,
              "workers": WORKERS, "horizons": list(horizons), "every": every, "records": records,
              "summary": summarize_horizons(records, horizons, base),
              "cost": quiet_estimate(lab.compute, time.perf_counter() - started)}
    ctx.write(report)
    print(render_horizons(report))
    log.info("wrote %s", ctx.out)
    return 0


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


@dataclass(frozen=True)
class Settings(Estimate):
    arms: tuple[str, ...] = option((), "central:lr=X or fed:lr=X,rounds=R,steps=S,server_lr=L (omitted keys: the "
                                   "defaults)", nargs="+", metavar="ARM", required=True)
    seeds: int = option(1, "training seeds per arm, 0..N-1")
    total_steps: int = option(TOTAL_STEPS, "optimiser steps of every arm")
    horizons: tuple[int, ...] | None = option(None, "budgets of optimiser steps in all to report, e.g. 24 48 72: one "
                                              "run per arm and seed for the longest, checkpoints every --every steps "
                                              "(replaces --total-steps)", nargs="+", type=int, metavar="STEPS")
    every: int | None = option(None, "with --horizons: score validation every this many optimiser steps in all, a "
                               "whole number of federated rounds (default: the smallest horizon)", type=int)
    heldout: bool = option(False, "with --horizons: also score held-out, only at each horizon's fixed and "
                           "validation-chosen checkpoints, and compare federated with central per horizon")
    cache: Path | None = option(None, "with --horizons: keep each run's checkpoints in DIR and reuse them when run "
                                "again", type=Path, metavar="DIR")
    model: str = REAL_MODEL
    validation_problems: int = VALIDATION_PROBLEMS
    """Validation problems scored (--quick: 8)."""
    heldout_limit: int | None = None
    """Held-out problems scored with --heldout (None: all; --quick: 8)."""

    def __post_init__(self) -> None:
        for name in ("seeds", "total_steps", "every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.horizons is None:
            for name in ("every", "heldout", "cache"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(f"--{name} needs --horizons")
        else:
            if min(self.horizons) < 1:
                raise ValueError(f"--horizons must be at least 1, got {min(self.horizons)}")
            horizons = tuple(sorted(set(self.horizons)))
            every = self.every or horizons[0]
            off = [h for h in horizons if h % every]
            if off:
                raise ValueError(f"--horizons {off} are not multiples of --every {every}")
            if self.cache is not None and self.cache.exists() and not self.cache.is_dir():
                raise ValueError(f"--cache {self.cache} is not a directory")
            for name, value in (("horizons", horizons), ("every", every), ("total_steps", horizons[-1])):
                object.__setattr__(self, name, value)  # the longest horizon is every arm's run
        try:
            for arm in self.parsed_arms():
                if self.horizons is not None:
                    checkpoint_steps(arm, self.total_steps, self.every or 1, WORKERS)
        except ValueError as exc:
            raise ValueError(str(exc).replace("--total-steps", "the longest of --horizons" if self.horizons
                                              else "--total-steps")) from None

    def parsed_arms(self) -> list[Arm]:
        return [parse_arm(spec, self.total_steps, WORKERS) for spec in self.arms]


def run(s: Settings, ctx: Run) -> int:
    started = time.perf_counter()
    arms = s.parsed_arms()
    if s.horizons is not None:
        return run_horizons(s, ctx, arms, started)
    scored = s.validation_problems
    if s.estimate:
        plan = planned_cost(len(arms) * s.seeds * s.total_steps, scored * (1 + len(arms) * s.seeds),
                            s.priced_from or ctx.out)
        print(render_plan("bench.fvc_sweep", plan))
        return 0
    domain = next(d for d in ds1000_domains() if d.name == DOMAIN)
    validation = domain.validation[:scored]
    lab = Lab(s.model)
    base = loss_pair(lab.losses(validation))
    records = []
    for i, (arm, seed) in enumerate([(a, seed) for a in arms for seed in range(s.seeds)], start=1):
        records.append(run_arm(lab, arm, domain.train, validation, seed, s.total_steps, WORKERS))
        log.info("[%d/%d] %s seed %d: validation %.4f", i, len(arms) * s.seeds, arm.label, seed,
                 records[-1]["loss"])
    report = {"benchmark": "fvc_sweep", "base_model": lab.model_id, "domain": DOMAIN, "split": "validation",
              "validation_problems": len(validation), "workers": WORKERS, "total_steps": s.total_steps,
              "records": records, "summary": summarize(records, base),
              "cost": quiet_estimate(lab.compute, time.perf_counter() - started)}
    ctx.write(report)
    print(render(report))
    log.info("wrote %s", ctx.out)
    return 0


BENCH = Bench("fvc_sweep", tags=("learning", "sweep"), settings=Settings, run=run, cores=1,
              quick={"model": SMOKE_MODEL, "validation_problems": 8, "heldout_limit": 8})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
