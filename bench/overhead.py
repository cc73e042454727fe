#!/usr/bin/env python3
"""Sync overhead: a worker's training throughput with a sync every 10 s versus no coordinator at all.

One process, one tiny-qwen2 LoRA trainer, torch pinned to one thread. Phases of equal length
alternate between two modes on the same trainer:

- ``local``: plain training steps, no coordinator anywhere;
- ``overlap``: ``FederatedWorker.run`` against a real coordinator process on loopback, syncing
  every ``--sync-interval`` seconds the way run_worker.py does by default (background push and
  pull, a checkpoint in a state dir at every sync);
- ``blocking`` (optional, ``--modes``): the same with ``--no-overlap``, training waiting for each sync.

Rounds run the modes in ABBA order (local, overlap, overlap, local, ...) so that a drift in the
machine's load hits both alike. A mode's throughput is its tokens over its phases' seconds;
``sync_overhead_pct`` = 100 * (1 - overlap / local). The final push a worker makes on exit is a
one-off, not part of the steady state, and is left out of the phase's time.

On a shared machine wall-clock throughput swings by tens of percent from one phase to the next
with other processes' load, far more than the effect measured. Two figures do not depend on it:
``cpu_overhead_pct`` compares tokens per CPU-second of this process (training plus the sync
thread: encoding, checkpoint, HTTP, decoding; the coordinator runs in its own process), and
``blocked_pct`` is the share of the phase the training thread spent on syncs (snapshot, adopting
the pull, waiting).

    python -m bench.overhead                      # 4 rounds of 12 s phases, ~2 min
    python -m bench.overhead --modes local overlap blocking --rounds 1

Table on stdout, progress on stderr, results in bench/results/overhead.json.
"""
from __future__ import annotations

import logging
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import SCRATCH_DIR, coordinator_process, format_table, sample_path
from bench.harness import Bench, Run
from protocol.cli import option
from protocol.client import CoordinatorClient
from worker.data import load_examples, split_examples
from worker.federation import FederatedWorker, SyncSettings
from models.loading import load_base_model
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench.overhead")
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

BASE_MODEL = "tiny-qwen2"
SPECIALTY = "python_expert"
TARGET_PCT = 2.0
MODES = ("local", "overlap", "blocking")


@dataclass(frozen=True)
class Phase:
    """One timed stretch of training in one mode."""

    round: int
    mode: str
    seconds: float
    cpu_seconds: float
    """CPU time of this process (training and sync threads) during the phase."""
    steps: int
    tokens: int
    syncs: int
    """Syncs begun during the phase (the final push on exit not counted)."""
    blocked_seconds: float
    """Training-thread time spent on syncs during the phase."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def local_phase(trainer: LoraTrainer, seconds: float, round_: int) -> Phase:
    steps = tokens = 0
    started, cpu_started = time.monotonic(), time.process_time()
    while time.monotonic() - started < seconds:
        stats = trainer.train_steps(1)
        steps, tokens = steps + stats.steps, tokens + stats.tokens
    return Phase(round_, "local", time.monotonic() - started, time.process_time() - cpu_started, steps, tokens,
                 0, 0.0)


def federated_phase(worker: FederatedWorker, mode: str, seconds: float, round_: int) -> Phase:
    worker.retune(duration=seconds, overlap=mode == "overlap")
    syncs_before = worker.syncs
    summary = worker.run()
    return Phase(round_, mode, summary.seconds, summary.cpu_seconds, summary.steps, summary.tokens,
                 summary.syncs - syncs_before, summary.blocked_seconds)


@dataclass(frozen=True)
class Settings:
    phase_seconds: float = option(12.0, "length of each timed phase")
    rounds: int = option(4, "rounds of one phase per mode")
    sync_interval: float = option(10.0, "seconds between syncs")
    modes: tuple[str, ...] = option(("local", "overlap"), "modes to compare; local and overlap are required",
                                    nargs="+", choices=MODES)
    lora_rank: int = option(8, "LoRA rank")
    batch_size: int = option(8, "examples per step")
    max_seq_len: int = option(128, "tokens per example")

    def __post_init__(self) -> None:
        if not {"local", "overlap"} <= set(self.modes):
            raise ValueError("--modes must include local and overlap")
        if self.rounds < 1 or not self.phase_seconds > 0 or not self.sync_interval > 0:
            raise ValueError("--rounds must be >= 1, --phase-seconds and --sync-interval > 0")


def measure(s: Settings) -> dict[str, Any]:
    torch.set_num_threads(1)
    started = time.perf_counter()
    train, _ = split_examples(load_examples(sample_path(SPECIALTY)))
    base = load_base_model(BASE_MODEL)
    trainer = LoraTrainer(base, LoraSettings(rank=s.lora_rank),
                          TrainSettings(lr=1e-2, batch_size=s.batch_size, max_seq_len=s.max_seq_len), train)
    spec = {"lora": trainer.lora_config, "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
    phases: list[Phase] = []
    with tempfile.TemporaryDirectory(prefix="fedmoe-overhead-", dir=SCRATCH_DIR) as scratch, \
            coordinator_process(Path(scratch) / "coordinator") as coordinator:
        url = coordinator.url
        settings = SyncSettings(specialty=SPECIALTY, worker_id="overhead-bench", sync_interval=s.sync_interval,
                                duration=s.phase_seconds, state_dir=Path(scratch) / "worker-state")
        worker = FederatedWorker(settings, CoordinatorClient(url), trainer, spec)
        worker.joining.join()
        trainer.train_steps(2)  # warm-up: first steps allocate
        for r in range(s.rounds):
            order = list(s.modes) if r % 2 == 0 else list(reversed(s.modes))
            for mode in order:
                phase = (local_phase(trainer, s.phase_seconds, r) if mode == "local"
                         else federated_phase(worker, mode, s.phase_seconds, r))
                phases.append(phase)
                log.info("round %d %-8s %6.0f tokens/s, %d sync(s), %.3f s blocked", r, mode, phase.tokens_per_s,
                         phase.syncs, phase.blocked_seconds)
        expert = CoordinatorClient(url).experts.get(SPECIALTY)
    return summarize(phases, s, expert, time.perf_counter() - started)


def summarize(phases: Sequence[Phase], s: Settings, expert: dict[str, Any],
              seconds: float) -> dict[str, Any]:
    modes: dict[str, dict[str, Any]] = {}
    for mode in s.modes:
        mine = [p for p in phases if p.mode == mode]
        total, cpu = sum(p.seconds for p in mine), sum(p.cpu_seconds for p in mine)
        tokens = sum(p.tokens for p in mine)
        modes[mode] = {"tokens_per_s": tokens / total, "tokens_per_cpu_s": tokens / cpu, "seconds": round(total, 3),
                       "steps": sum(p.steps for p in mine), "syncs": sum(p.syncs for p in mine),
                       "blocked_pct": 100 * sum(p.blocked_seconds for p in mine) / total}
    local = modes["local"]["tokens_per_s"]
    for mode, m in modes.items():
        m["overhead_pct"] = 100 * (1 - m["tokens_per_s"] / local)
        m["cpu_overhead_pct"] = 100 * (1 - m["tokens_per_cpu_s"] / modes["local"]["tokens_per_cpu_s"])
    overhead, cpu_overhead = modes["overlap"]["overhead_pct"], modes["overlap"]["cpu_overhead_pct"]
    per_round = []
    for r in range(s.rounds):
        by_mode = {p.mode: p.tokens_per_s for p in phases if p.round == r}
        per_round.append(round(100 * (1 - by_mode["overlap"] / by_mode["local"]), 3))
    return {"config": {"base_model": BASE_MODEL, "lora_rank": s.lora_rank, "batch_size": s.batch_size,
                       "max_seq_len": s.max_seq_len, "sync_interval": s.sync_interval,
                       "phase_seconds": s.phase_seconds, "rounds": s.rounds, "torch_threads": 1},
            "phases": [asdict(p) | {"tokens_per_s": p.tokens_per_s} for p in phases],
            "modes": modes, "sync_overhead_pct": overhead, "overhead_pct_per_round": per_round,
            "cpu_overhead_pct": cpu_overhead,
            "target": {"max_overhead_pct": TARGET_PCT, "met": overhead <= TARGET_PCT,
                       "cpu_met": cpu_overhead <= TARGET_PCT},
            "expert": {"version": expert["version"], "updates_applied": expert["updates_applied"]},
            "seconds": round(seconds, 1)}


def render(report: dict[str, Any]) -> str:
    rows = [[mode, round(m["tokens_per_s"], 1), round(m["tokens_per_cpu_s"], 1), m["steps"], m["syncs"],
             round(m["blocked_pct"], 3), round(m["overhead_pct"], 2), round(m["cpu_overhead_pct"], 2)]
            for mode, m in report["modes"].items()]
    table = format_table(["mode", "tokens/s", "tokens/cpu-s", "steps", "syncs", "blocked %", "overhead %",
                          "cpu overhead %"], rows)
    verdict = "met" if report["target"]["met"] else "NOT met"
    rounds = ", ".join(f"{v:.1f}" for v in report["overhead_pct_per_round"])
    return (f"{table}\n\noverlap vs local per round (%, load noise): {rounds}\n"
            f"sync every {report['config']['sync_interval']:g} s, background push/pull: "
            f"{report['sync_overhead_pct']:.2f}% fewer tokens/s than no coordinator "
            f"(target <= {TARGET_PCT:g}%: {verdict}); per CPU-second {report['cpu_overhead_pct']:.2f}%")


def run(s: Settings, ctx: Run) -> int:
    report = measure(s)
    ctx.write(report)
    print(render(report))
    log.info("wrote %s in %.0f s", ctx.out, report["seconds"])
    return 0


BENCH = Bench("overhead", tags=("performance",), settings=Settings, run=run,
              quick={"phase_seconds": 3.0, "rounds": 1, "sync_interval": 1.0})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
