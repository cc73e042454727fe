#!/usr/bin/env python3
"""A training worker's peak memory and speed: the loss over every position's logits vs the chunked
answer-only loss, with and without activation checkpointing and a fixed malloc mmap threshold.

Every (model, configuration) runs in a fresh child process, so ``ru_maxrss`` (the process's peak
resident size) belongs to that configuration alone. Each child loads the model, builds a LoRA r=8
trainer at the worker's default batch (8 x 256 tokens of DS-1000 numpy problems) and takes
``--steps`` optimiser steps with one torch thread. Reported per row: peak RSS, RSS after loading
the model, tokens/s and tokens per CPU second (the first step, a warm-up, excluded; on a shared
machine the CPU figure is the steadier one), and the largest difference of its per-step losses
from the ``before`` row's (the loss curve must not move).

``qwen2-0.5b`` is Qwen2-0.5B's shape (config sizes as published) with seeded random weights and
tiny-qwen2's tokenizer: memory does not depend on the weights' values. Its ``before`` rows would
not fit beside other work on a shared 24 GB machine at batch 8, so it runs at batches 1 and 2
and the table extrapolates the line through them to batch 8 (``--qwen-batches``).

    python -m bench.worker_memory                                   # ~1 h on a quiet 2-core machine
    python -m bench.worker_memory --models tiny-qwen2 --steps 3     # smoke test, ~1 minute

Table on stdout, results in bench/results/worker_memory.json (stamped with commit and load).
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from bench.harness import Bench, Run
from protocol.cli import comma_list, option
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "worker_memory.json"
DATASET = ROOT / "data" / "ds1000" / "train" / "numpy_expert.jsonl"
BATCH_SIZE, MAX_SEQ_LEN = 8, 256  # the worker's defaults (run_worker.py --batch-size, --max-seq-len)


@dataclass(frozen=True)
class MemoryConfig:
    """One way of running the same training steps."""

    loss_path: str
    """worker.losses: "logits" (every position from the first answer token on) or "chunked"."""
    checkpointing: bool | None
    """Activation checkpointing: on, off, or None for the worker's own choice (--gradient-checkpointing auto)."""
    release: bool
    """Fix glibc's mmap threshold (worker.memory.release_freed_memory), as the worker does at start."""


CONFIGS: dict[str, MemoryConfig] = {
    "before": MemoryConfig("logits", False, False),
    "chunked loss": MemoryConfig("chunked", False, False),
    "chunked + mmap threshold": MemoryConfig("chunked", False, True),
    "chunked + checkpointing": MemoryConfig("chunked", True, False),
    "after": MemoryConfig("chunked", None, True),
    "logits lean": MemoryConfig("logits", True, True),
}
"""``before`` is the worker as it was; ``after`` is the worker's defaults now. ``logits lean`` is the old loss
path with the new memory settings (checkpointing recomputes the same arithmetic): the loss curve's reference in
a long run where ``before``'s 6 GB would crowd a shared machine."""
MODELS = ("tiny-qwen2", "smollm2-135m", "qwen2-0.5b")
QWEN2_05B: dict[str, Any] = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                             "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                             "tie_word_embeddings": True}
"""Qwen/Qwen2-0.5B-Instruct's sizes (its config.json); what memory depends on."""


def load_model(name: str) -> Any:
    """The BaseModel of ``name``; qwen2-0.5b is built from its config with seeded random weights."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from models.loading import BaseModel, load_base_model

    if name != "qwen2-0.5b":
        return load_base_model(name)
    tiny = load_base_model("tiny-qwen2")  # its tokenizer's ids (< 3,000) are valid in any larger vocabulary
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN2_05B)).eval()
    return BaseModel(model, tiny.tokenizer, name, "random weights")


def run_child(model_name: str, config: MemoryConfig, steps: int, batch_size: int) -> dict[str, Any]:
    """What one configuration costs, measured in this (fresh) process."""
    import torch

    from worker.data import load_examples
    from worker.memory import release_freed_memory
    from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

    torch.set_num_threads(1)
    if config.release:
        release_freed_memory()
    base = load_model(model_name)
    loaded = peak_rss_mb()
    settings = TrainSettings(lr=1e-3, batch_size=batch_size, max_seq_len=MAX_SEQ_LEN, seed=0,
                             gradient_checkpointing=config.checkpointing, loss_path=config.loss_path)
    trainer = LoraTrainer(base, LoraSettings(rank=8), settings, load_examples(DATASET))
    losses, tokens, wall, cpu = [], 0, 0.0, 0.0
    for step in range(steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        stats = trainer.train_steps(1)
        losses.append(stats.loss)
        if step > 0 or steps == 1:  # the first step warms up (allocations, thread pools) unless it is the only one
            tokens += stats.tokens
            wall += time.perf_counter() - started
            cpu += time.process_time() - cpu_started
    return {"model": model_name, "batch_size": batch_size, "checkpointing": trainer.checkpointing,
            "peak_rss_mb": peak_rss_mb(), "rss_after_load_mb": loaded, "tokens_per_s": tokens / wall,
            "tokens_per_cpu_s": tokens / cpu, "losses": losses}


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(model_name: str, config_name: str, steps: int, batch_size: int) -> dict[str, Any]:
    """Run one configuration in a fresh interpreter and return its row."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "bench.worker_memory", "--child", model_name, config_name, str(steps),
               str(batch_size)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{model_name} / {config_name} failed:\n{done.stderr[-3000:]}")
    return {"config": config_name, **asdict(CONFIGS[config_name]), **json.loads(done.stdout.splitlines()[-1])}


def git_head() -> str:
    """The checkout's commit, with "+changes" when its tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def loss_drift(rows: list[dict[str, Any]]) -> None:
    """Set each row's largest per-step loss difference from the reference row of its model and batch size:
    `before`, else the first row on the full-logits loss path."""
    reference: dict[tuple[str, int], list[float]] = {}
    for r in sorted(rows, key=lambda r: r["config"] != "before"):
        if r["loss_path"] == "logits":
            reference.setdefault((r["model"], r["batch_size"]), r["losses"])
    for row in rows:
        before = reference.get((row["model"], row["batch_size"]))
        row["max_loss_difference"] = None if before is None else \
            max(abs(a - b) for a, b in zip(row["losses"], before))


def extrapolate(rows: list[dict[str, Any]], model: str, batch_size: int) -> list[dict[str, Any]]:
    """Per configuration of ``model``, peak RSS at ``batch_size`` on the line through its two smallest batches."""
    out = []
    for config in CONFIGS:
        measured = sorted((r for r in rows if r["model"] == model and r["config"] == config),
                          key=lambda r: r["batch_size"])
        if len(measured) < 2 or batch_size in {r["batch_size"] for r in measured}:
            continue
        (b1, m1), (b2, m2) = [(r["batch_size"], r["peak_rss_mb"]) for r in measured[:2]]
        out.append({"model": model, "config": config, "batch_size": batch_size, "extrapolated_from": [b1, b2],
                    "peak_rss_mb": m1 + (m2 - m1) * (batch_size - b1) / (b2 - b1),
                    "per_example_mb": (m2 - m1) / (b2 - b1)})
    return out


def print_table(rows: list[dict[str, Any]], estimates: list[dict[str, Any]]) -> None:
    from bench.common import format_table

    print(format_table(
        ["model", "config", "batch", "ckpt", "peak RSS MB", "after load MB", "tokens/s", "tokens/CPU s",
         "max loss diff"],
        [[r["model"], r["config"], f"{r['batch_size']} x {MAX_SEQ_LEN}", "on" if r["checkpointing"] else "off",
          round(r["peak_rss_mb"]), round(r["rss_after_load_mb"]), round(r["tokens_per_s"], 1),
          round(r["tokens_per_cpu_s"], 1),
          "-" if r["max_loss_difference"] is None else f"{r['max_loss_difference']:.1e}"] for r in rows],
        align="lllrrrrrr"))
    for e in estimates:
        print(f"{e['model']} {e['config']}: ~{e['peak_rss_mb']:.0f} MB peak RSS at batch {e['batch_size']} "
              f"x {MAX_SEQ_LEN} (extrapolated from batches {e['extrapolated_from']}, {e['per_example_mb']:.0f} MB "
              "per example)")


def _batches(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in comma_list(text, flag))
    except ValueError:
        raise ValueError(f"{flag} wants comma-separated integers, got {text!r}") from None


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...] = option(("tiny-qwen2", "smollm2-135m", "qwen2-0.5b"), "comma-separated subset of: "
                                     + ", ".join(MODELS), parse=comma_list)
    configs: tuple[str, ...] = option(tuple(CONFIGS), "comma-separated subset of: " + ", ".join(CONFIGS),
                                      parse=comma_list)
    steps: int = option(20, "optimiser steps per configuration")
    qwen_batches: tuple[int, ...] = option((1, 2), f"batch sizes qwen2-0.5b runs at; the table extrapolates to "
                                           f"{BATCH_SIZE} from the two smallest", parse=_batches)
    qwen_steps: int = option(2, "steps per qwen2-0.5b configuration")
    child: tuple[str, ...] | None = option(None, "(a child process: MODEL CONFIG STEPS BATCH)", nargs=4, hidden=True)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.models) - set(MODELS)) + sorted(set(self.configs) - set(CONFIGS))
        if unknown or self.steps < 2 or self.qwen_steps < 1 or min(self.qwen_batches) < 1:
            raise ValueError(f"unknown --models/--configs {unknown}, or --steps < 2, --qwen-steps or --qwen-batches "
                             "< 1")


def run(s: Settings, ctx: Run) -> int:
    if s.child:
        name, config, child_steps, child_batch = s.child
        print(json.dumps(run_child(name, CONFIGS[config], int(child_steps), int(child_batch))))
        return 0
    rows = []
    for model in s.models:
        batches, steps = (s.qwen_batches, s.qwen_steps) if model == "qwen2-0.5b" else ((BATCH_SIZE,), s.steps)
        for batch in batches:
            for config in s.configs:
                rows.append(measure(model, config, steps, batch))
                print(f"{model} {config} batch {batch}: {rows[-1]['peak_rss_mb']:.0f} MB", file=sys.stderr)
    loss_drift(rows)
    estimates = [e for m in s.models if m == "qwen2-0.5b" for e in extrapolate(rows, m, BATCH_SIZE)]
    ctx.write({"steps": s.steps, "max_seq_len": MAX_SEQ_LEN, "dataset": str(DATASET.relative_to(ROOT)), "rows": rows,
               "qwen2_0.5b_batch_8_estimates": estimates})
    print_table(rows, estimates)
    print(f"results in {ctx.out}")
    return 0


BENCH = Bench("worker_memory", tags=("training",), settings=Settings, run=run, cores=1,
              quick={"models": ("tiny-qwen2",), "steps": 3})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
