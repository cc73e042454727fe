#!/usr/bin/env python3
"""A worker's own CPU per sync, phase by phase: what a sync costs once the link is fast.

One in-process smollm2-135m worker (LoRA rank 8 on all seven projections, batch 1 of 32 tokens,
one torch thread: bench.wan's link-bound preset) against a real coordinator process on loopback,
with a state dir on disk (real fsyncs). Every round is one training step then one whole sync
(``FederatedWorker.sync``, as ``--no-overlap`` does), so everything runs on this thread and
``time.thread_time`` charges each phase its own CPU seconds, whatever the machine's load:

- ``snapshot``: begin_sync (the adapter's snapshot, the optimiser's copy for the checkpoint);
- ``encode``: the delta and its codec (worker.encoding);
- ``checkpoint``: worker.resume.save (worker.checkpoint: the tensors, fsync, the manifest);
- ``push``: the outbox over HTTP; ``pull``: the expert's weights (HTTP, parse, digest, decode);
- ``adopt``: W + r (+ local - snapshot) loaded into the model;
- ``sync total``: the process's CPU over the whole sync; ``train step``: one training step's, for scale.

Variants (``--variants``) run in ABAB blocks of ``--syncs`` syncs on the same worker, each with its
own state dir, so load drift hits both alike:

- ``legacy``: the checkpoint as written before 2026-11-26 (five safetensors files serialised to
  bytes, each fsynced, at every sync), kept here as the baseline;
- ``current``: worker.checkpoint as it is.

    python -m bench.sync_cost                        # 2 blocks of 10 syncs per variant, ~3 min
    python -m bench.sync_cost --compression int8     # with an error-feedback residual

Table on stdout, progress on stderr, results in bench/results/sync_cost.json.
"""
from __future__ import annotations

import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import coordinator_process, format_table, sample_path
from bench.harness import Bench, Run
from protocol.cli import option
from protocol.client import CoordinatorClient
from protocol.files import fsync_dir, write_atomically
from protocol.tensors import dumps
from worker import resume
from worker.checkpoint import MANIFEST, CheckpointWriter, WorkerCheckpoint, _write_durably, flatten_optimizer
from worker.data import load_examples, split_examples
from worker.encoding import CompressionSettings, PullSettings, UpdateEncoder
from worker.federation import FederatedWorker, SyncSettings
from models.loading import load_base_model
from worker.sync_state import ExpertState
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.sync_cost")
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

SPECIALTY = "sql_expert"
PHASES = ("snapshot", "encode", "checkpoint", "push", "pull", "adopt")
VARIANTS = ("legacy", "current")


def legacy_save_checkpoint(state_dir: Path, checkpoint: WorkerCheckpoint) -> Path:
    """The checkpoint writer before 2026-11-26, the baseline: every tensor set serialised to bytes and
    written to its own fsynced file at every sync (outbox bodies always rewritten)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = state_dir / MANIFEST
    number = json.loads(manifest_path.read_text())["sequence"] + 1 if manifest_path.is_file() else 0
    target = state_dir / f"ckpt-{number:06d}"
    target.mkdir()
    optimizer_tensors, optimizer_meta = flatten_optimizer(checkpoint.optimizer)
    written = []
    for name, tensors in (("adapter", checkpoint.adapter), ("reference", checkpoint.reference),
                          ("pulled", checkpoint.pulled), ("residual", checkpoint.residual),
                          ("optimizer", optimizer_tensors)):
        if tensors:
            _write_durably(target / f"{name}.safetensors", dumps(tensors))
            written.append(name)
    outbox = []
    for i, (body, meta) in enumerate(checkpoint.outbox):
        _write_durably(target / f"outbox-{i}.bin", body)
        outbox.append({"file": f"outbox-{i}.bin", "meta": meta})
    fsync_dir(target)
    manifest = {"format": 1, "sequence": number, "directory": target.name, "tensors": written,
                "identity": checkpoint.identity, "progress": checkpoint.progress, "optimizer": optimizer_meta,
                "outbox": outbox}
    write_atomically(state_dir / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    for old in state_dir.glob("ckpt-*"):
        if old != target:
            shutil.rmtree(old, ignore_errors=True)
    return target


class PhaseClock:
    """CPU seconds of this thread per phase, summed over the calls of the current sync."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += time.thread_time() - started
        return timed

    def take(self) -> dict[str, float]:
        out, self.current = dict(self.current), defaultdict(float)
        return out


def legacy_save(writer: CheckpointWriter, checkpoint: WorkerCheckpoint, encoder: UpdateEncoder,
                state: ExpertState) -> float:
    """worker.resume.save before 2026-11-26: the pulled weights kept whatever the pull settings, the
    residual copied, then the legacy writer."""
    started = time.perf_counter()
    checkpoint.pulled = state.pulled  # as captured then (no pull happens between capture and save)
    checkpoint.residual = encoder.state_dict()
    checkpoint.outbox = [(o.body, o.meta) for o in state.outbox]
    legacy_save_checkpoint(writer.state_dir, checkpoint)
    return time.perf_counter() - started


@contextmanager
def instrumented(worker: FederatedWorker, clock: PhaseClock) -> Iterator[None]:
    """Time the worker's sync steps (``checkpoint`` is timed by ``variant``)."""
    steps = worker.pipeline
    steps.begin_sync = clock.wrap("snapshot", steps.begin_sync)  # type: ignore[method-assign]
    steps._encode = clock.wrap("encode", steps._encode)  # type: ignore[method-assign]
    steps.push = clock.wrap("push", steps.push)  # type: ignore[method-assign]
    steps._pull = clock.wrap("pull", steps._pull)  # type: ignore[method-assign]
    steps.adopt = clock.wrap("adopt", steps.adopt)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name in ("begin_sync", "_encode", "push", "_pull", "adopt"):
            vars(steps).pop(name, None)


@contextmanager
def variant(name: str, clock: PhaseClock) -> Iterator[None]:
    """worker.resume.save as the variant has it (``legacy``: the old writer), timed as ``checkpoint``."""
    original = resume.save
    resume.save = clock.wrap("checkpoint", legacy_save if name == "legacy" else original)
    try:
        yield
    finally:
        resume.save = original


def measure(s: Settings) -> dict[str, Any]:
    torch.set_num_threads(1)
    started, cpu_started = time.perf_counter(), time.process_time()
    train, _ = split_examples(load_examples(sample_path(SPECIALTY)))
    base = load_base_model(s.base_model)
    trainer = LoraTrainer(base, LoraSettings(rank=s.lora_rank),
                          TrainSettings(lr=1e-3, batch_size=1, max_seq_len=32), train)
    spec = {**trainer.expert_config, "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
    codec = CompressionSettings(codec=s.compression, sync_budget=s.sync_budget)
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in s.variants}
    with tempfile.TemporaryDirectory(prefix="fedmoe-sync-cost-", dir=s.state_parent) as scratch, \
            coordinator_process(Path(scratch) / "coordinator") as coordinator:
        settings = SyncSettings(specialty=SPECIALTY, worker_id="sync-cost", sync_interval=1.0, overlap=False,
                                state_dir=Path(scratch) / "state-warmup")
        # full-weight pulls (or auto's pick), as the figures in docs/wan.md were measured before int8 diffs became
        # the default
        worker = FederatedWorker(settings, CoordinatorClient(coordinator.url), trainer, spec,
                                 encoder=UpdateEncoder(codec), pull=PullSettings(codec=None))
        worker.joining.join()
        worker.train_step()
        worker.sync()  # warm-up: first allocations, the codec climb of auto
        clock = PhaseClock()
        with instrumented(worker, clock):
            for block in range(s.blocks):
                for name in s.variants:
                    worker.retune(state_dir=Path(scratch) / f"state-{name}-{block}")
                    with variant(name, clock):
                        for _ in range(s.syncs):
                            step_started = time.thread_time()
                            worker.train_step()
                            step_cpu = time.thread_time() - step_started
                            clock.take()
                            cpu = time.process_time()
                            record = worker.sync()
                            phases = clock.take() | {"total": time.process_time() - cpu, "train_step": step_cpu}
                            phases["bytes_down"] = record.get("bytes_down", 0)
                            samples[name].append(phases)
                    mine = samples[name][-s.syncs:]
                    log.info("block %d %-8s total %.3f CPU s/sync, checkpoint %.3f", block, name,
                             statistics.median(p["total"] for p in mine),
                             statistics.median(p.get("checkpoint", 0.0) for p in mine))
    return summarize(samples, s, time.perf_counter() - started, time.process_time() - cpu_started)


def summarize(samples: dict[str, list[dict[str, float]]], s: Settings, seconds: float,
              cpu_seconds: float) -> dict[str, Any]:
    variants = {}
    for name, rows in samples.items():
        variants[name] = {phase: round(statistics.median(r.get(phase, 0.0) for r in rows), 4)
                          for phase in (*PHASES, "total", "train_step")} | {"syncs": len(rows)}
    report: dict[str, Any] = {
        "config": {"base_model": s.base_model, "lora_rank": s.lora_rank, "compression": s.compression,
                   "sync_budget": s.sync_budget, "syncs_per_block": s.syncs, "blocks": s.blocks,
                   "torch_threads": 1, "state_dir_on": str(s.state_parent)},
        "variants": variants, "per_sync": samples, "seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1),
        "note": "median CPU seconds of this thread per phase (time.thread_time); total = process CPU per sync"}
    if "legacy" in variants and "current" in variants:
        legacy, current = variants["legacy"], variants["current"]
        report["ratios"] = {phase: round(legacy[phase] / current[phase], 2) if current[phase] else None
                            for phase in ("checkpoint", "total")}
    return report


def render(report: dict[str, Any]) -> str:
    headers = ["variant", *PHASES, "sync total", "train step", "syncs"]
    rows = [[name, *(v[p] for p in PHASES), v["total"], v["train_step"], v["syncs"]]
            for name, v in report["variants"].items()]
    text = format_table(headers, rows)
    if "ratios" in report:
        text += (f"\n\nlegacy / current (median CPU s per sync): checkpoint {report['ratios']['checkpoint']}x, "
                 f"whole sync {report['ratios']['total']}x")
    return text


@dataclass(frozen=True)
class Settings:
    base_model: str = option("smollm2-135m", "preset")
    lora_rank: int = option(8, "LoRA rank")
    compression: str = option("safetensors", "the worker's --compression (safetensors: uncompressed)")
    sync_budget: float | None = option(None, "with --compression auto", type=float)
    syncs: int = option(10, "syncs per block")
    blocks: int = option(2, "ABAB blocks per variant")
    variants: tuple[str, ...] = option(VARIANTS, "variants compared", nargs="+", choices=VARIANTS)
    state_parent: Path = option(Path(tempfile.gettempdir()), "where the state dirs go: on disk, not in RAM, so fsync "
                                "costs what it costs", type=Path)

    def __post_init__(self) -> None:
        if self.syncs < 1 or self.blocks < 1:
            raise ValueError(f"--syncs and --blocks must be >= 1, got {self.syncs} and {self.blocks}")
        CompressionSettings(codec=self.compression, sync_budget=self.sync_budget)  # its ValueError names the flag


def run(s: Settings, ctx: Run) -> int:
    report = measure(s)
    print(render(report))
    ctx.write(report)
    log.info("wrote %s", ctx.out)
    return 0


BENCH = Bench("sync_cost", tags=("training",), settings=Settings, run=run,
              quick={"base_model": "tiny-qwen2", "syncs": 2, "blocks": 1})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
