#!/usr/bin/env python3
"""Compression and federated-vs-central quality on a real model (smollm2-135m, DS-1000 pandas).

One expert, three workers, each on its own third of pandas_expert's training problems, in
synchronous rounds (bench/fedrounds.py: real trainer, real codecs and error feedback, FedBuff
averaging). The same job runs once per codec for ``rounds`` rounds; the uncompressed job (fp32
safetensors) is the codecs' reference after those rounds, and it goes on to ``fvc_rounds`` rounds
as the federated side of federated-vs-central, where one worker trains on all of the domain for
the same total number of optimiser steps (same compute): 8 rounds x 3 workers x 2 steps = 48.

Figures, all on the 33 held-out pandas problems (with and without the end-of-answer token):
- per codec: bytes ratio vs fp32 (every byte of every pushed update), held-out loss increase vs
  the fp32 run after the same steps (mean +/- spread over codec seeds for random codecs), the
  mean relative error and cosine of what was decoded against what the worker meant to send, and
  the rounds to a target loss (80% of the fp32 run's gain on a validation subset);
- federated vs central: held-out loss of each over training seeds, central after the same total
  number of optimiser steps (same compute) and after as many steps as one federated worker takes
  (same wall time, when the workers train in parallel and the network costs nothing). FedBuff's
  server learning rate is ``--server-lr`` (the coordinator's flag; 1 applies the mean of the
  workers' deltas, so a round moves about as far as one worker's steps: bench/fedrounds.py). Each
  arm has its own AdamW lr, picked on the validation split by bench.fvc_sweep for 48 steps in all
  (bench/results/history/quality_fvc_sweep_horizon.json): the federated workers ``--lr`` (default 3e-3), the
  central worker ``--central-lr`` (default 5e-4; at 24 steps central wants the preset's 1e-3).
The per-codec error against a whole expert's true delta comes from the gateway suite's experts
(bench/quality_gateway.py, ``codec_true_delta``).

    python -m bench.quality_compression            # smollm2-135m (make smollm2)
    python -m bench.quality_compression --quick    # tiny-qwen2 smoke run, seconds
    python -m bench.quality_compression --fvc-only --out bench/results/history/quality_fvc_tuned.json  # workers at lr 3e-3
    python -m bench.quality_compression --estimate # planned optimiser steps and scored problems, no model
"""
from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


from bench.common import format_table
from bench.harness import Bench, Run
from bench.compression import FP16, UNBIASED, CodecRun
from bench.fedrounds import FedJob, FedResult, run_central, run_fed
from bench.realdata import (REAL_MODEL, SMOKE_MODEL, Estimate, Lab, ds1000_domains, heldout_size, loss_pair,
                            pct, planned_cost, quiet_estimate, render_plan, shards, spread)
from compression import encode_update, make_codec, measure
from compression.wire import decode_update
from protocol.cli import option
from protocol.schemas import RAW_CODEC
from protocol.tensors import StateDict, dumps, manifest_of
from worker.encoding import CompressionSettings

log = logging.getLogger("bench.quality_compression")
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

DOMAIN = "pandas_expert"
SWEEP: tuple[CodecRun, ...] = (
    CodecRun(RAW_CODEC),
    CodecRun("int8", {"block_size": 256, **FP16}),
    CodecRun("randomk+terngrad", {"ratio": 0.1, **UNBIASED}, error_feedback=False),
    CodecRun("topk+int8", {"ratio": 0.01, **FP16}),
)
EXTRA: tuple[CodecRun, ...] = (CodecRun("signsgd"),)
"""Not in the default sweep (time budget; 31.7x at +1.16% on 2026-11-24); ``--only signsgd`` runs it."""
QUICK_SWEEP = (SWEEP[0], SWEEP[1], SWEEP[2])
TARGETS = (  # (name, codec family or None for any, min ratio, max held-out loss increase in %)
    ("int8 within 0.1%", "int8", 3.9, 0.1),
    (">= 100x within 1% (moonshot)", None, 100.0, 1.0),
)
FED_VS_CENTRAL_PCT = 2.0
TARGET_GAIN = 0.8
"""Rounds to target: the first round a run's validation loss has 80% of the fp32 run's final gain."""


@dataclass(frozen=True)
class Settings(Estimate):
    model: str = REAL_MODEL
    workers: int = 3
    rounds: int = option(4, "rounds per codec job")
    steps: int = option(2, "AdamW steps per worker per round (batch 4 x <= 128 tokens)")
    seeds: int = option(3, "training seeds of the fp32 and central runs")
    codec_seeds: int = option(3, "codec seeds of each random codec (training seed 0)")
    fvc_rounds: int = option(8, "rounds of the uncompressed jobs, federated vs central's federated arm; at least "
                             "--rounds")
    """The codecs are compared with the uncompressed runs' snapshot after ``rounds``: 8 x 3 workers x 2 steps = 48
    optimiser steps in all, a horizon at which both arms stop improving on validation (bench.fvc_sweep; 24 steps is
    too early for either)."""
    track: int = option(8, "validation problems whose loss is taken every round")
    server_lr: float = option(1.0, "FedBuff's server learning rate in every federated run (the coordinator's "
                              "--server-lr; the number of workers applies the sum of their deltas)")
    fedasync: bool = option(False, "also run FedAsync (the coordinator's default rule) against central (3 more jobs)")
    lr: float | None = option(3e-3, "the federated workers' AdamW learning rate, in every federated run (tuned for "
                              "smollm2-135m on validation; --quick: the preset's, models.presets.RECOMMENDED_LR)")
    """3e-3 = 3 workers x smollm2's single-worker 1e-3, the best of 1e-3..5e-3 on the validation split
    (bench.fvc_sweep; docs/history/benchmarks.md). None: the preset's recommended one."""
    central_lr: float | None = option(5e-4, "the central worker's AdamW learning rate (validation's pick at 48 steps; "
                                      "--quick: the preset's)")
    """The preset's 1e-3 overfits from ~36 steps (bench.fvc_sweep's horizon sweep)."""
    only: tuple[str, ...] | None = option(None, "only these codec specs (the fp32 reference always runs), e.g. --only "
                                          "int8 topk+int8; signsgd is not in the default sweep but may be named here",
                                          nargs="+", metavar="CODEC")
    fvc_only: bool = option(False, "only federated vs central: the fp32 federated runs and the central runs, "
                            "no codecs")
    sweep: tuple[CodecRun, ...] = SWEEP
    """The codecs compared (--quick: three)."""

    def __post_init__(self) -> None:
        for name in ("rounds", "fvc_rounds", "steps", "seeds", "codec_seeds", "track"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("server_lr", "lr", "central_lr"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
        if self.fvc_rounds < self.rounds:
            raise ValueError(f"--fvc-rounds ({self.fvc_rounds}) must be at least --rounds ({self.rounds})")
        if self.fvc_only and self.only:
            raise ValueError("--fvc-only runs no codecs; drop --only")
        known = {run.codec for run in (*SWEEP, *EXTRA)}
        if self.only and set(self.only) - known:
            raise ValueError(f"--only: {sorted(set(self.only) - known)} not in the sweep; choose from {sorted(known)}")

    @property
    def fvc_steps(self) -> int:
        """Optimiser steps in all of each federated-vs-central arm."""
        return self.fvc_rounds * self.steps * self.workers

    def runs(self) -> tuple[CodecRun, ...]:
        """The fp32 reference first, then the codecs compared with it."""
        sweep = self.sweep
        if self.only:
            known = {run.codec: run for run in (*SWEEP, *EXTRA)}
            sweep = (SWEEP[0], *(known[c] for c in dict.fromkeys(self.only) if c != RAW_CODEC))
        return sweep[:1] if self.fvc_only else sweep


QUICK = {"model": SMOKE_MODEL, "rounds": 2, "steps": 1, "seeds": 1, "codec_seeds": 1, "fvc_rounds": 3, "track": 4,
         "lr": None, "central_lr": None, "sweep": QUICK_SWEEP}


def run_job(lab: Lab, train: Sequence, track: Sequence, s: Settings, run: CodecRun, seed: int,
            codec_seed: int, aggregation: str = "fedbuff", rounds: int | None = None) -> FedResult:
    """``rounds`` (default ``s.rounds``) rounds of ``run``'s codec; past ``s.rounds`` the expert after ``s.rounds``
    is kept in the result's snapshots (the codecs' reference)."""
    compression = CompressionSettings(codec=run.codec, config=run.seeded_config(codec_seed),
                                      error_feedback=run.error_feedback)
    rounds = rounds or s.rounds
    job = FedJob(tuple(tuple(x) for x in shards(train, s.workers)), rounds, s.steps, seed=seed,
                 compression=compression, codec_seed=codec_seed, aggregation=aggregation, track=tuple(track),
                 server_lr=s.server_lr, lr=s.lr, snapshot_every=s.rounds if rounds > s.rounds else 0)
    return run_fed(lab, job)


def first_rounds(result: FedResult, s: Settings, rounds: int) -> FedResult:
    """The part of a ``rounds``-round fp32 run the codecs are compared with: its first ``s.rounds`` rounds.
    Every fp32 round sends the same bytes, so the byte counts scale with the rounds."""
    if rounds == s.rounds:
        return result
    return dataclasses.replace(result, weights=result.snapshots[s.rounds * s.steps * s.workers],
                               track_losses=result.track_losses[:s.rounds],
                               bytes_sent=result.bytes_sent * s.rounds // rounds,
                               bytes_raw=result.bytes_raw * s.rounds // rounds, updates=result.updates * s.rounds // rounds,
                               relative_error=result.relative_error[:len(result.relative_error) * s.rounds // rounds],
                               cosine=result.cosine[:len(result.cosine) * s.rounds // rounds])


def estimate(plan: Sequence[tuple[CodecRun, int, int]], s: Settings, measured: Path) -> dict[str, Any]:
    """Optimiser steps and scored problems of ``plan`` plus the fedasync and central runs, priced from ``measured``."""
    heldout = heldout_size(DOMAIN)
    fed_steps, fed_evals = s.rounds * s.steps * s.workers, heldout + s.track * s.rounds
    codec_jobs = sum(1 for run, _, _ in plan if run.codec != RAW_CODEC)
    long_jobs = len(plan) - codec_jobs + (s.seeds if s.fedasync else 0)  # fp32 and fedasync run fvc_rounds
    long_evals = heldout * (2 if s.fvc_rounds > s.rounds else 1) + s.track * s.fvc_rounds
    central_evals = heldout + s.track * s.fvc_rounds + heldout  # tracked like a round, plus the same-wall-time snapshot
    return planned_cost(codec_jobs * fed_steps + (long_jobs + s.seeds) * s.fvc_steps,
                        heldout + s.track + codec_jobs * fed_evals + (len(plan) - codec_jobs) * long_evals
                        + (s.seeds if s.fedasync else 0) * (heldout + s.track * s.fvc_rounds)
                        + s.seeds * central_evals, measured)


def job_record(lab: Lab, result: FedResult, heldout: Sequence, label: str, seed: int, codec_seed: int,
               base_track: float) -> dict[str, Any]:
    losses = loss_pair(lab.losses(heldout, result.weights, result.lora))
    return {"label": label, "seed": seed, "codec_seed": codec_seed, **losses,
            "ratio": result.bytes_raw / result.bytes_sent if result.bytes_sent else None,
            "bytes_sent": result.bytes_sent, "updates": result.updates,
            "relative_error": statistics.fmean(result.relative_error) if result.relative_error else None,
            "cosine": statistics.fmean(result.cosine) if result.cosine else None,
            "track": [round(t["loss"], 5) for t in result.track_losses], "track_base": base_track}


def rounds_to(track: Sequence[float], target: float) -> int | None:
    """First round (1-based) whose tracked loss is at or below ``target``."""
    return next((i + 1 for i, loss in enumerate(track) if loss <= target), None)


def summarize(records: Sequence[dict[str, Any]], federated: Sequence[dict[str, Any]], fedasync: Sequence[dict[str, Any]],
              central: Sequence[dict[str, Any]], central_wall: Sequence[dict[str, Any]], base: Mapping[str, float],
              s: Settings) -> dict[str, Any]:
    """``records``: every codec's runs after ``s.rounds`` (fp32's from its snapshot); ``federated``: the fp32 runs
    after ``s.fvc_rounds``, compared with ``central`` at the same optimiser steps in all."""
    fp32 = [r for r in records if r["label"] == CodecRun(RAW_CODEC).label]
    reference = next(r for r in fp32 if r["seed"] == 0)
    target = reference["track_base"] - TARGET_GAIN * (reference["track_base"] - reference["track"][-1])
    codecs = {}
    for label in dict.fromkeys(r["label"] for r in records):
        group = [r for r in records if r["label"] == label and (r["seed"] == 0)]
        codecs[label] = {
            "ratio": group[0]["ratio"],
            "increase_pct": spread([pct(r["loss"], reference["loss"]) for r in group]),
            "increase_pct_without_end": spread([pct(r["loss_without_end"], reference["loss_without_end"])
                                                for r in group]),
            "relative_error": spread([r["relative_error"] for r in group]),
            "cosine": spread([r["cosine"] for r in group]),
            "rounds_to_target": [rounds_to(r["track"], target) for r in group],
        }
    fed_lr = {"server_lr": s.server_lr, "lr": s.lr, "steps_in_all": s.fvc_steps}
    fvc = {"central": {**versus(central, central), "lr": s.central_lr, "steps_in_all": s.fvc_steps}}
    fvc["fedbuff"] = {**versus(federated, central), **fed_lr}
    if fedasync:
        fvc["fedasync"] = {**versus(fedasync, central), **fed_lr}
    if central_wall:  # the same wall time: central after as many steps as one federated worker took
        fvc["central_same_wall_time"] = {**versus(central_wall, central), "steps": s.fvc_rounds * s.steps,
                                         "lr": s.central_lr}
        fvc["fedbuff_vs_same_wall_time"] = {**versus(federated, central_wall), **fed_lr}
    compressed = len(codecs) > 1
    return {
        "base_heldout": base, "reference": {k: reference[k] for k in ("loss", "loss_without_end")},
        "target_track_loss": target, "codecs": codecs,
        "targets": {name: target_status(codecs, family, ratio, limit) for name, family, ratio, limit in TARGETS}
        if compressed else {},
        "best_ratio_within_1pct": max((c["ratio"] for label, c in codecs.items()
                                       if c["increase_pct"]["max"] is not None and c["increase_pct"]["max"] <= 1.0),
                                      default=None),
        "federated_vs_central": fvc,
    }


def versus(runs: Sequence[dict[str, Any]], central: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Held-out loss of ``runs`` over seeds and its gap to the central runs' mean (target: within 2%)."""
    loss, loss_ne = spread([r["loss"] for r in runs]), spread([r["loss_without_end"] for r in runs])
    ref, ref_ne = statistics.fmean(r["loss"] for r in central), statistics.fmean(r["loss_without_end"] for r in central)
    gap = pct(loss["mean"], ref)
    return {"loss": loss, "loss_without_end": loss_ne, "gap_pct": gap, "gap_pct_without_end": pct(loss_ne["mean"], ref_ne),
            "met": gap <= FED_VS_CENTRAL_PCT}


def target_status(codecs: Mapping[str, Mapping[str, Any]], family: str | None, min_ratio: float,
                  max_pct: float) -> dict[str, Any]:
    """Met by every configuration whose ratio reaches ``min_ratio`` with its *worst* codec seed within ``max_pct``."""
    met = [label for label, c in codecs.items() if not label.startswith(RAW_CODEC)
           and (family is None or label.split(" ")[0] == family) and c["ratio"] >= min_ratio
           and c["increase_pct"]["max"] is not None and c["increase_pct"]["max"] <= max_pct]
    return {"met": bool(met), "by": met}


def true_delta_figures(deltas: Sequence[StateDict], sweep: Sequence[CodecRun] = SWEEP) -> dict[str, Any]:
    """Each codec applied once to whole experts' deltas: ratio, relative error and cosine to the true delta."""
    out = {}
    for run in sweep:
        if run.codec == RAW_CODEC:
            continue
        codec = make_codec(run.codec, run.seeded_config(0))
        rows = []
        for i, delta in enumerate(deltas):
            manifest = manifest_of(delta)
            body = encode_update(delta, manifest, codec, seed=i)
            rows.append(measure(delta, decode_update(body, manifest, codec), body, 0.0, 0.0))
        out[run.label] = {"ratio": statistics.fmean(r["ratio"] for r in rows),
                          "relative_error": spread([r["relative_error"] for r in rows]),
                          "cosine": spread([r["cosine"] for r in rows]), "deltas": len(rows)}
    out[CodecRun(RAW_CODEC).label] = {"ratio": 4 * sum(t.numel() for t in deltas[0].values()) / len(dumps(deltas[0])),
                                      "relative_error": spread([0.0]), "cosine": spread([1.0]), "deltas": len(deltas)}
    return out


def render(report: Mapping[str, Any]) -> str:
    rows = []
    for label, c in report["summary"]["codecs"].items():
        inc, inc_ne = c["increase_pct"], c["increase_pct_without_end"]
        rows.append([label, f"{c['ratio']:.1f}x", f"{inc['mean']:+.2f} ({inc['min']:+.2f}..{inc['max']:+.2f}, n={inc['n']})",
                     f"{inc_ne['mean']:+.2f}", f"{c['relative_error']['mean']:.3f}", f"{c['cosine']['mean']:.3f}",
                     ",".join(str(r) for r in c["rounds_to_target"])])
    lines = [format_table(["codec", "ratio", "held-out loss vs fp32 % (seeds)", "w/o end %", "rel err", "cosine",
                           "rounds to target"], rows, align="lrlrrrl"), ""]
    fvc = report["summary"]["federated_vs_central"]
    lines.append(f"federated vs central, {fvc['central'].get('steps_in_all')} optimiser steps in all:")
    for label, v in fvc.items():
        against = "central same wall time" if label == "fedbuff_vs_same_wall_time" else "central"
        name = {"central_same_wall_time": f"central after {v.get('steps')} steps (same wall time)",
                "fedbuff_vs_same_wall_time": "fedbuff"}.get(label, label)
        if v.get("lr"):
            name += f" (lr {v['lr']:g})"
        if "server_lr" in v:
            name += f" (server lr {v['server_lr']:g})"
        lines.append(f"{name}: held-out {v['loss']['mean']:.4f} +/- {v['loss']['std']:.4f} (n={v['loss']['n']}), "
                     f"{v['gap_pct']:+.2f}% vs {against} (without end token {v['gap_pct_without_end']:+.2f}%)"
                     + (f": {'met' if v['met'] else 'NOT met'}" if label in ("fedbuff", "fedasync") else ""))
    for name, t in report["summary"]["targets"].items():
        lines.append(f"target {name}: " + (f"met by {', '.join(t['by'])}" if t["met"] else "NOT met"))
    return "\n".join(lines)


def run(s: Settings, ctx: Run) -> int:
    sweep = s.runs()
    plan = [(job, seed, 0) for job in sweep[:1] for seed in range(s.seeds)]
    plan += [(job, 0, c) for job in sweep[1:] for c in range(s.codec_seeds if job.random_stages() else 1)]
    if s.estimate:
        print(render_plan("bench.quality_compression", estimate(plan, s, s.priced_from or ctx.out)))
        return 0
    started = time.perf_counter()
    domain = next(d for d in ds1000_domains() if d.name == DOMAIN)
    lab = Lab(s.model)
    track, heldout = domain.validation[:s.track], domain.heldout
    base = loss_pair(lab.losses(heldout))
    base_track = loss_pair(lab.losses(track))["loss"]
    records, federated = [], []
    for i, (job, seed, codec_seed) in enumerate(plan, start=1):
        rounds = s.fvc_rounds if job.codec == RAW_CODEC else s.rounds
        result = run_job(lab, domain.train, track, s, job, seed, codec_seed, rounds=rounds)
        records.append(job_record(lab, first_rounds(result, s, rounds), heldout, job.label, seed, codec_seed, base_track))
        if job.codec == RAW_CODEC:
            federated.append(job_record(lab, result, heldout, "fedbuff", seed, codec_seed, base_track)
                             if rounds > s.rounds else records[-1])
            log.info("fedbuff seed %d after %d steps in all: held-out %.4f", seed, s.fvc_steps, federated[-1]["loss"])
        log.info("[%d/%d] %s seed %d codec seed %d: held-out %.4f, %.1fx", i, len(plan), job.label, seed, codec_seed,
                 records[-1]["loss"], records[-1]["ratio"] or 0)
    fedasync = []
    for seed in range(s.seeds if s.fedasync else 0):
        result = run_job(lab, domain.train, track, s, sweep[0], seed, 0, aggregation="fedasync", rounds=s.fvc_rounds)
        fedasync.append(job_record(lab, result, heldout, "fedasync", seed, 0, base_track))
        log.info("fedasync seed %d: held-out %.4f", seed, fedasync[-1]["loss"])
    central, central_wall = [], []
    wall_steps = s.fvc_rounds * s.steps
    for seed in range(s.seeds):
        result = run_central(lab, domain.train, s.fvc_steps, seed, track, every=s.steps * s.workers,
                             snapshots=(wall_steps,), lr=s.central_lr)
        central.append(job_record(lab, result, heldout, "central", seed, 0, base_track))
        if wall_steps in result.snapshots:
            central_wall.append({"label": f"central after {wall_steps} steps", "seed": seed, **loss_pair(
                lab.losses(heldout, result.snapshots[wall_steps], result.lora))})
        log.info("central seed %d: held-out %.4f (after %d steps: %s)", seed, central[-1]["loss"], wall_steps,
                 f"{central_wall[-1]['loss']:.4f}" if central_wall else "-")
    report = {"benchmark": "quality_compression", "base_model": s.model, "domain": DOMAIN, "quick": ctx.quick,
              "fvc_only": s.fvc_only, "settings": asdict(s), "heldout_problems": len(heldout), "records": records,
              "federated": federated, "fedasync": fedasync, "central": central, "central_same_wall_time": central_wall,
              "summary": summarize(records, federated, fedasync, central, central_wall, base, s),
              "cost": quiet_estimate(lab.compute, time.perf_counter() - started)}
    ctx.write(report)
    print(render(report))
    log.info("wrote %s", ctx.out)
    return 0


BENCH = Bench("quality_compression", tags=("quality",), settings=Settings, run=run, quick=QUICK, cores=1)
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
