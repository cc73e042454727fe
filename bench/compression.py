#!/usr/bin/env python3
"""Compression benchmark: the same federated job once per codec, judged against the uncompressed run.

A job is a fresh coordinator on loopback and three workers on tiny-qwen2, one expert per domain,
with fixed seeds and a fixed number of sync rounds. The workers take turns in one process (one
AdamW step, then a sync: push the encoded delta, pull the expert), so a job is deterministic and
the jobs of a suite differ only in the update codec. Syncing after every step is the regime the
published figures (DGC, SparseLoCo) come from; with several steps per sync every lossy codec
does worse (``--steps``). Error feedback is on except for the unbiased stochastic codecs marked
"no EF", which do better without it.

A codec's score is the held-out loss of the experts it produced (mean over the three domains)
relative to the ``safetensors`` run of the same suite, and its all-in size: every byte of every
pushed update body (indices, scales, seeds and framing included) against 4 bytes per parameter
per update. Stochastic codecs run with one codec seed by default; ``--seeds N`` averages N.

    python -m bench.compression             # full sweep on sample data and DS-1000, ~4 min on 2 cores
    python -m bench.compression --quick     # 3 codecs, 2 rounds, sample data only, ~15 s
    python -m bench.compression --only randomk+terngrad terngrad --seeds 4

Table on stdout, progress on stderr, results in bench/results/compression.json.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import (Domain, Suite, Task, configure_logging, format_table, load_suites, pulled_tensors,
                          run_parallel, running_coordinator)
from bench.harness import Bench, Run
from bench.plots import plot_codec_bytes
from compression import CODECS, CompressionError, Pipeline, make_codec
from protocol.cli import option
from protocol.client import CoordinatorClient
from protocol.errors import FedMoEError
from protocol.schemas import RAW_CODEC
from worker.encoding import CompressionSettings, PullSettings, UpdateEncoder
from bench.heldout import adapter_loss
from worker.federation import FederatedWorker, SyncSettings
from models.loading import load_base_model
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench.compression")
# peft still asks transformers for is_gradient_checkpointing; the deprecation notice is not ours to act on.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

BASE_MODEL = "tiny-qwen2"
TARGETS = (  # (name, codec family or None for any, min ratio, max eval-loss increase in %)
    ("int8: >= 3.9x within 0.1%", "int8", 3.9, 0.1),
    (">= 32x within 0.5%", None, 32.0, 0.5),
    (">= 100x within 1%", None, 100.0, 1.0),
)

FULL_PULLS = PullSettings(codec=None)
"""Full-weight pulls (the workers' default until 2026-11-29, when int8 diffs became it)."""


@dataclass(frozen=True)
class CodecRun:
    """One configuration of the sweep: a codec spec, its options and whether error feedback is on."""

    codec: str
    """'safetensors' (the uncompressed reference) or a compression spec such as 'topk+int4'."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """Codec options, flat (a pipeline routes each key to the stage that has it)."""
    error_feedback: bool = True
    """Carry what the codec dropped into the next update. Unbiased stochastic codecs (terngrad,
    rescaled randomk) do better without it: their noise averages out over rounds, while error
    feedback keeps adding it back."""

    @property
    def label(self) -> str:
        options = ",".join(f"{k}={v}" for k, v in self.config.items())
        return f"{self.codec} {options}".strip() + ("" if self.error_feedback else " (no EF)")

    def random_stages(self) -> list[str]:
        """Stages whose output depends on a seed (stochastic rounding, random selection or start)."""
        if self.codec == RAW_CODEC:
            return []
        codec = make_codec(self.codec, dict(self.config))
        stages = [codec.sparsifier, codec.quantizer] if isinstance(codec, Pipeline) else [codec]
        return [c.name for c in stages if hasattr(c.config, "seed") and getattr(c.config, "stochastic", True)]

    def seeded_config(self, seed: int) -> dict[str, Any]:
        """The codec options with every random stage seeded by ``seed`` (0 keeps the defaults)."""
        random = self.random_stages()
        if seed == 0 or not random:
            return dict(self.config)
        stages = self.codec.split("+")
        if len(stages) == 1:
            return {**self.config, "seed": seed}
        if all(key in stages for key in self.config):  # already one mapping per stage
            per_stage = {name: dict(self.config.get(name, {})) for name in stages}
        else:
            keys = {name: {f.name for f in dataclasses.fields(CODECS[name].config_class)} for name in stages}
            per_stage = {name: {k: v for k, v in self.config.items() if k in keys[name]} for name in stages}
        return {name: {**options, **({"seed": seed} if name in random else {})} for name, options in per_stage.items()}


FP16 = {"scale_dtype": "fp16"}  # 2-byte block scales: int8 in 256-value blocks costs 8.06 bits a value
UNBIASED = {"rescale": True}  # randomk scaled by numel/k, so the estimate is unbiased
SWEEP: tuple[CodecRun, ...] = (
    CodecRun(RAW_CODEC),
    CodecRun("none"),
    CodecRun("fp16"),
    CodecRun("bf16"),
    CodecRun("int8", {"block_size": 256, **FP16}),
    CodecRun("int4", {"block_size": 64, **FP16}),
    CodecRun("natural", {"bits": 3}),
    CodecRun("qsgd", {"levels": 7, "bucket_size": 64}),
    CodecRun("terngrad"),
    CodecRun("terngrad", error_feedback=False),
    CodecRun("signsgd"),
    CodecRun("powersgd", {"rank": 1}),
    CodecRun("threshold+int4", {"threshold": 0.01, **FP16}),
    CodecRun("randomk+fp16", {"ratio": 0.1, **UNBIASED}, error_feedback=False),
    CodecRun("topk", {"ratio": 0.1}),
    CodecRun("topk+signsgd", {"ratio": 0.1}),
    CodecRun("topk+int8", {"ratio": 0.03, **FP16}),
    CodecRun("topk+int4", {"ratio": 0.01, **FP16}),
    CodecRun("randomk+terngrad", {"ratio": 0.25, **UNBIASED}, error_feedback=False),
    CodecRun("randomk+terngrad", {"ratio": 0.1, **UNBIASED}, error_feedback=False),
)
QUICK_SWEEP: tuple[CodecRun, ...] = (
    CodecRun(RAW_CODEC),
    CodecRun("int8", {"block_size": 256, **FP16}),
    CodecRun("topk+int4", {"ratio": 0.01, **FP16}),
)


@dataclass(frozen=True)
class JobSettings:
    """What every job of a run shares; only the codec differs between the jobs of a suite."""

    rounds: int = 48
    """Sync rounds; each worker trains and pushes once per round."""
    steps_per_round: int = 1
    """Optimiser steps each worker takes between two syncs."""
    batch_size: int = 4
    """Examples per step (4 learns more per second than 8 on the tiny model)."""
    max_seq_len: int = 128
    """Token window for training and evaluation."""
    lr: float = 2e-3
    """AdamW learning rate (the random-init tiny model needs a large one to learn in a minute)."""
    lora_rank: int = 8
    """LoRA rank r."""
    lora_alpha: float = 16.0
    """LoRA alpha."""
    seed: int = 0
    """Worker i trains with seed + i (LoRA init and data order)."""
    codec_seeds: int = 1
    """Codec seeds per configuration with a random stage; their results are averaged."""
    threads: int = 1
    """torch threads per job."""

    def __post_init__(self) -> None:
        for name in ("rounds", "steps_per_round", "batch_size", "codec_seeds", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_seq_len < 16:
            raise ValueError(f"max_seq_len must be at least 16, got {self.max_seq_len}")


@dataclass(frozen=True)
class JobResult:
    """What one job measured."""

    suite: str
    run: CodecRun
    codec_seed: int
    losses: dict[str, float]
    """Held-out loss of each domain's expert on its own domain (empty if the job failed)."""
    bytes_sent: int
    """Bytes of every pushed update body, all workers, all rounds."""
    bytes_raw: int
    """4 bytes per parameter per pushed update (fp32 LoRA deltas)."""
    updates: int
    relative_error: float | None
    """Mean over updates of ||delta - decoded|| / ||delta|| (delta before error feedback is added)."""
    seconds: float
    error: str | None = None
    """Why the job stopped early (e.g. training diverged to NaN), else None."""

    @property
    def eval_loss(self) -> float:
        """Mean over domains; NaN for a failed job."""
        return statistics.fmean(self.losses.values()) if self.losses else math.nan


# -- one job -------------------------------------------------------------------------------------


def run_job(suite: Suite, run: CodecRun, settings: JobSettings, codec_seed: int = 0) -> JobResult:
    """The federated job with ``run``'s codec: join, ``rounds`` x (train, sync) per worker, evaluate."""
    started = time.perf_counter()
    torch.set_num_threads(settings.threads)
    compression = CompressionSettings(codec=run.codec, config=run.seeded_config(codec_seed),
                                      error_feedback=run.error_feedback)
    syncs: list[dict[str, Any]] = []
    losses, error = {}, None
    with running_coordinator() as url:
        client = CoordinatorClient(url)
        team = [join_worker(client, domain, compression, settings, i) for i, domain in enumerate(suite.domains)]
        try:
            for _ in range(settings.rounds):
                for worker in team:
                    worker.interval.add(worker.trainer.train_steps(settings.steps_per_round))
                    syncs.append(checked_sync(worker))
        except (CompressionError, FedMoEError, ValueError) as exc:  # NaN weights: the codec made training diverge
            error = f"round {len(syncs) // len(team) + 1}: {exc}"
            log.warning("%s %s (codec seed %d) failed in %s", suite.name, run.label, codec_seed, error)
        else:
            losses = expert_losses(client, suite.domains, settings)
        client.close()
    return JobResult(suite=suite.name, run=run, codec_seed=codec_seed, losses=losses,
                     bytes_sent=sum(r["bytes_sent"] for r in syncs), bytes_raw=sum(r["bytes_raw"] for r in syncs),
                     updates=len(syncs), seconds=time.perf_counter() - started, error=error,
                     relative_error=statistics.fmean(r["relative_error"] for r in syncs) if syncs else None)


def join_worker(client: CoordinatorClient, domain: Domain, compression: CompressionSettings,
                settings: JobSettings, index: int) -> FederatedWorker:
    base = load_base_model(BASE_MODEL)  # each trainer wraps its base model in place: one per worker
    trainer = LoraTrainer(base, LoraSettings(rank=settings.lora_rank, alpha=settings.lora_alpha),
                          TrainSettings(lr=settings.lr, batch_size=settings.batch_size,
                                        max_seq_len=settings.max_seq_len, seed=settings.seed + index),
                          list(domain.train))
    spec = {"lora": trainer.lora_config, "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
    worker = FederatedWorker(SyncSettings(specialty=domain.name, worker_id=f"bench-{domain.name}"), client,
                             trainer, spec, encoder=UpdateEncoder(compression),
                             pull=FULL_PULLS)  # the push codecs compared over exact pulls, as measured
    worker.joining.join()
    return worker


def checked_sync(worker: FederatedWorker) -> dict[str, Any]:
    """One sync that must have pushed an update and pulled the result (loopback never drops one)."""
    record = worker.sync()
    if not record.get("bytes_sent") or not record["delivered"] or not record["pulled"]:
        raise RuntimeError(f"{worker.settings.worker_id}: sync {record['sync']} did not push and pull an update")
    return record


def expert_losses(client: CoordinatorClient, domains: Sequence[Domain], settings: JobSettings) -> dict[str, float]:
    """Held-out loss of each expert as the coordinator holds it, on its own domain."""
    base = load_base_model(BASE_MODEL)
    return {d.name: adapter_loss(base, d.heldout, pulled_tensors(client.experts.pull(d.name)), client.experts.get(d.name)["lora"],
                                 max_seq_len=settings.max_seq_len) for d in domains}


def untrained_losses(suite: Suite, settings: JobSettings) -> dict[str, float]:
    """Held-out loss of the base model itself (where every LoRA starts: B = 0)."""
    torch.set_num_threads(settings.threads)
    base = load_base_model(BASE_MODEL)
    return {d.name: adapter_loss(base, d.heldout, max_seq_len=settings.max_seq_len) for d in suite.domains}


def plan_tasks(suites: Sequence[Suite], sweep: Sequence[CodecRun], settings: JobSettings) -> list[Task]:
    """One job per suite, configuration and codec seed (one seed for deterministic codecs)."""
    tasks: list[Task] = [(run_job, (suite, run, settings, seed)) for suite in suites for run in sweep
                         for seed in range(settings.codec_seeds if run.random_stages() else 1)]
    return tasks + [(untrained_losses, (suite, settings)) for suite in suites]


def log_progress(total: int) -> Any:
    def on_result(done: int, result: Any) -> None:
        if isinstance(result, JobResult):
            outcome = f"FAILED ({result.error})" if result.error else f"loss {result.eval_loss:.4f}"
            seed = f" (codec seed {result.codec_seed})" if result.codec_seed else ""
            log.info("[%d/%d] %s %s%s: %s, %.1fx, %.1f s", done, total, result.suite, result.run.label, seed,
                     outcome, result.bytes_raw / max(result.bytes_sent, 1), result.seconds)
    return on_result


# -- report --------------------------------------------------------------------------------------


def summarize(results: Sequence[JobResult], untrained: Mapping[str, dict[str, float]],
              settings: JobSettings, seconds: float) -> dict[str, Any]:
    """One record per suite and configuration, relative to the suite's safetensors run; targets."""
    reference = {r.suite: r.eval_loss for r in results if r.run.codec == RAW_CODEC and not r.error}
    missing = {r.suite for r in results} - set(reference)
    if missing:
        raise RuntimeError(f"the {RAW_CODEC!r} reference run failed or is missing for suite(s) {sorted(missing)}")
    groups: dict[tuple[str, str], list[JobResult]] = {}
    for r in results:
        groups.setdefault((r.suite, r.run.label), []).append(r)
    records = [record(group, reference[suite]) for (suite, _), group in groups.items()]
    best = best_within(records, 1.0)
    return {
        "benchmark": "compression",
        "base_model": BASE_MODEL,
        "settings": asdict(settings),
        "reference_codec": RAW_CODEC,
        "suites": {suite: {"reference_eval_loss": loss, "untrained_eval_loss": statistics.fmean(untrained[suite].values()),
                           "untrained_losses": untrained[suite]} for suite, loss in reference.items()},
        "records": records,
        "best_ratio_within_1pct": best["ratio"] if best else None,
        "best_within_1pct": best,
        "targets": {name: target_status(records, family, ratio, pct) for name, family, ratio, pct in TARGETS},
        "seconds": round(seconds, 1),
    }


def record(group: Sequence[JobResult], reference_loss: float) -> dict[str, Any]:
    """A configuration's record on one suite, averaged over codec seeds; losses are None if any seed failed."""
    run, failed = group[0].run, [r.error for r in group if r.error]
    bytes_sent, bytes_raw = sum(r.bytes_sent for r in group), sum(r.bytes_raw for r in group)
    ratio = bytes_raw / bytes_sent if bytes_sent else None
    finite = not failed and all(math.isfinite(r.eval_loss) for r in group)
    loss = statistics.fmean(r.eval_loss for r in group) if finite else None

    def increase(value: float) -> float:
        return 100.0 * (value - reference_loss) / reference_loss

    errors = [e for e in (r.relative_error for r in group) if e is not None]
    return {
        "suite": group[0].suite, "codec": run.codec, "config": dict(run.config),
        "error_feedback": run.error_feedback, "label": run.label,
        "ratio": ratio, "bits_per_param": 32.0 / ratio if ratio else None, "eval_loss": loss,
        "eval_loss_increase_pct": increase(loss) if loss is not None else None,
        "codec_seeds": [r.codec_seed for r in group] if run.random_stages() else [],
        "eval_loss_increase_pct_by_seed": [increase(r.eval_loss) for r in group] if finite else None,
        "losses": {d: statistics.fmean(r.losses[d] for r in group) for d in group[0].losses} if finite else {},
        "bytes_sent": bytes_sent, "bytes_raw": bytes_raw, "updates": sum(r.updates for r in group),
        "relative_error": statistics.fmean(errors) if errors else None,
        "seconds": round(sum(r.seconds for r in group), 2), "error": "; ".join(failed) or None,
    }


def by_configuration(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Records grouped by configuration label (one record per suite)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(r["label"], []).append(r)
    return groups


def within(rs: Sequence[dict[str, Any]], min_ratio: float, max_pct: float) -> bool:
    """True when the configuration reaches both bounds on every suite."""
    return all(r["eval_loss_increase_pct"] is not None and r["eval_loss_increase_pct"] <= max_pct
               and r["ratio"] >= min_ratio for r in rs)


def best_within(records: Sequence[dict[str, Any]], max_pct: float) -> dict[str, Any] | None:
    """The configuration with the highest worst-suite ratio among those within ``max_pct`` on every suite."""
    qualifying = [{"label": label, "codec": rs[0]["codec"], "config": rs[0]["config"],
                   "error_feedback": rs[0]["error_feedback"], "ratio": min(r["ratio"] for r in rs),
                   "eval_loss_increase_pct": {r["suite"]: r["eval_loss_increase_pct"] for r in rs}}
                  for label, rs in by_configuration(records).items() if within(rs, 0.0, max_pct)]
    return max(qualifying, key=lambda q: q["ratio"], default=None)


def target_status(records: Sequence[dict[str, Any]], family: str | None, min_ratio: float,
                  max_pct: float) -> dict[str, Any]:
    candidates = {label: rs for label, rs in by_configuration(records).items()
                  if rs[0]["codec"] != RAW_CODEC and (family is None or rs[0]["codec"] == family)}
    met = [label for label, rs in candidates.items() if within(rs, min_ratio, max_pct)]
    return {"met": bool(met), "by": met, "candidates_run": len(candidates)}


def render(report: Mapping[str, Any]) -> str:
    """The results table and the summary lines, as plain text."""
    rows = [(r["suite"], r["label"], _fmt(r["ratio"], ".2f"), _fmt(r["bits_per_param"], ".3f"),
             _fmt(r["eval_loss"], ".4f"), _fmt(r["eval_loss_increase_pct"], "+.2f", "failed"), _spread(r),
             _fmt(r["relative_error"], ".3f"), _fmt(r["seconds"], ".1f")) for r in report["records"]]
    headers = ("suite", "codec", "ratio", "bits/param", "eval loss", "vs fp32 %", "codec seeds", "rel err", "s")
    lines = [format_table(headers, rows, align="llrrrrlrr"), ""]
    for suite, s in report["suites"].items():
        lines.append(f"{suite}: uncompressed eval loss {s['reference_eval_loss']:.4f} "
                     f"(untrained {s['untrained_eval_loss']:.4f})")
    best = report["best_within_1pct"]
    lines.append("best ratio within 1% on every suite: " + (f"{best['ratio']:.1f}x ({best['label']})" if best else "none"))
    for name, status in report["targets"].items():
        verdict = f"met by {', '.join(status['by'])}" if status["met"] else "NOT met"
        lines.append(f"target {name}: " + (verdict if status["candidates_run"] else "not run"))
    if report["settings"]["codec_seeds"] == 1 and any(r["codec_seeds"] for r in report["records"]):
        lines.append("stochastic codecs ran with one codec seed; near a bound, --seeds N (averaged) can change a verdict")
    return "\n".join(lines)


def _fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _spread(r: Mapping[str, Any]) -> str:
    """'-' for deterministic codecs, else the codec seeds' range of increases."""
    by_seed = r["eval_loss_increase_pct_by_seed"]
    if not r["codec_seeds"] or not by_seed:
        return "-"
    if len(by_seed) == 1:
        return "1"
    return f"{len(by_seed)}: {min(by_seed):+.2f}..{max(by_seed):+.2f}"


# -- command line --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    suites: tuple[str, ...] = option(("sample", "ds1000"), "data suites: sample (data/*.jsonl) and ds1000 "
                                     "(data/ds1000/)", nargs="+")
    only: tuple[str, ...] | None = option(None, "run only these codec specs (plus the safetensors reference), e.g. "
                                          "--only int8 topk+int4", nargs="+", metavar="CODEC")
    rounds: int = option(JobSettings.rounds, "sync rounds")
    steps: int = option(JobSettings.steps_per_round, "steps per round")
    seeds: int = option(JobSettings.codec_seeds, "codec seeds per configuration with a random stage")
    jobs: int = option(min(2, os.cpu_count() or 1), "jobs in parallel, one process each (--quick: 1, in this process)")
    threads: int = option(1, "torch threads per job")
    max_seq_len: int = JobSettings.max_seq_len
    sweep: tuple[CodecRun, ...] = SWEEP
    """The configurations run (--quick: three codecs)."""

    def __post_init__(self) -> None:
        if self.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, got {self.jobs}")
        known = {run.codec for run in SWEEP + QUICK_SWEEP}
        if self.only and set(self.only) - known:
            raise ValueError(f"--only: {sorted(set(self.only) - known)} not in the sweep; choose from {sorted(known)}")
        self.job_settings()  # its checks name the flags

    def job_settings(self) -> JobSettings:
        return JobSettings(rounds=self.rounds, steps_per_round=self.steps, codec_seeds=self.seeds,
                           threads=self.threads, max_seq_len=self.max_seq_len)

    def runs(self) -> tuple[CodecRun, ...]:
        if not self.only:
            return self.sweep
        return tuple(run for run in SWEEP if run.codec == RAW_CODEC or run.codec in self.only)


def run(s: Settings, ctx: Run) -> int:
    settings, sweep = s.job_settings(), s.runs()
    suites = load_suites(s.suites)
    tasks = plan_tasks(suites, sweep, settings)
    log.info("%d suite(s) x %d configurations: %d jobs of %d rounds x %d step(s) x 3 workers, %d at a time",
             len(suites), len(sweep), len(tasks) - len(suites), settings.rounds, settings.steps_per_round, s.jobs)
    outputs = run_parallel(tasks, s.jobs, log_progress(len(tasks)), configure_logging, (ctx.verbose,))
    results = [o for o in outputs if isinstance(o, JobResult)]
    untrained = {suite.name: o for suite, o in zip(suites, outputs[len(results):])}
    report = summarize(results, untrained, settings, ctx.seconds())
    ctx.write(report)
    plot = plot_codec_bytes(report["records"], ctx.out.with_suffix(".png"))
    print(render(report))
    log.info("wrote %s and %s in %.0f s", ctx.out, plot, report["seconds"])
    return 0


BENCH = Bench("compression", tags=("robustness",), settings=Settings, run=run,
              quick={"rounds": 2, "steps": 2, "max_seq_len": 64, "suites": ("sample",), "jobs": 1,
                     "sweep": QUICK_SWEEP})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
