#!/usr/bin/env python3
"""Strategies inside one worker on 2 CPU ranks (gloo): DDP vs FSDP vs FSDP + CPU offload vs DDP with
each comm codec, on a full-parameter tiny-qwen2 expert (every weight trains, so sharding matters).

Per configuration: tokens/s, peak RSS per rank (sampled after every step, so a lower bound),
bytes each rank puts on the wire per step (measured by the comm hook for codecs; for plain DDP and
FSDP computed from what the ring collectives move: an all-reduce of S bytes sends 2(N-1)/N * S per
rank, an all-gather or reduce-scatter of S bytes (N-1)/N * S), held-out loss after --steps steps,
and scaling efficiency 1 -> 2 ranks (2-rank tokens/s over twice the 1-rank tokens/s).

    python -m bench.strategies                 # about 3 minutes on a quiet 2-core machine
    python -m bench.strategies --steps 4       # smoke test

Table on stdout, results in bench/results/strategies.json.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import format_table, sample_path
from bench.harness import Bench, Run
from protocol.cli import comma_list, option
from worker.data import load_examples, split_examples
from worker.distributed import SingleProcess, TorchCollective
from models.loading import load_base_model
from worker.strategies import ParallelSettings
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

ROOT = Path(__file__).resolve().parents[1]

CONFIGS: dict[str, ParallelSettings] = {
    "ddp": ParallelSettings(strategy="ddp"),
    "fsdp": ParallelSettings(strategy="fsdp"),
    "fsdp-grad-op": ParallelSettings(strategy="fsdp-grad-op"),
    "fsdp+offload": ParallelSettings(strategy="fsdp", cpu_offload=True),
    "ddp+fp16": ParallelSettings(strategy="ddp", comm_compress="fp16"),
    "ddp+bf16": ParallelSettings(strategy="ddp", comm_compress="bf16"),
    "ddp+int8": ParallelSettings(strategy="ddp", comm_compress="int8"),
    "ddp+topk0.1": ParallelSettings(strategy="ddp", comm_compress="topk", comm_config={"ratio": 0.1}),
    "ddp+powersgd-r4": ParallelSettings(strategy="ddp", comm_compress="powersgd",
                                        comm_config={"matrix_approximation_rank": 4}),
}


def settings() -> TrainSettings:
    return TrainSettings(lr=3e-3, batch_size=8, max_seq_len=128, seed=0)


def data():
    return split_examples(load_examples(sample_path("sql_expert")))


def run_config(name: str, parallel: ParallelSettings, steps: int, collective: SingleProcess) -> dict[str, Any]:
    train, heldout = data()
    records: list[dict[str, Any]] = []
    trainer = LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(rank=0), settings(), train,
                          collective=collective, parallel=parallel, step_log=records.append)
    process = psutil.Process()
    trainer.train_steps(1)  # warm-up: DDP builds its buckets, FSDP initialises lazily
    records.clear()
    rss, tokens, started = 0, 0, time.perf_counter()
    for _ in range(steps):
        tokens += trainer.train_steps(1).tokens
        rss = max(rss, process.memory_info().rss)
    seconds = time.perf_counter() - started
    heldout_loss = trainer.eval_loss(heldout[:16])  # a collective under FSDP: every rank evaluates
    numel = sum(p.numel() for p in trainer.model.parameters())
    sent = [r["bytes_sent"] for r in records if "bytes_sent" in r]
    return {"config": name, "strategy": trainer.strategy, "tokens_per_s": tokens / seconds,
            "peak_rss_mb": rss / 2**20, "heldout_loss": heldout_loss,
            "bytes_per_step": sum(sent) / len(sent) if sent else wire_bytes(trainer.strategy, numel,
                                                                               collective.world_size),
            "bytes_measured": bool(sent),
            "grad_rel_error": _mean(r.get("grad_rel_error") for r in records),
            "grad_cosine": _mean(r.get("grad_cosine") for r in records)}


def wire_bytes(strategy: str, numel: int, world: int) -> float:
    """Bytes a rank sends per step for uncompressed float32 collectives over a ring (every weight trains)."""
    size, part = 4 * numel, (world - 1) / world
    moves = {"ddp": 2 * part * size,                              # one all-reduce of the gradients
             "fsdp": 2 * part * size + part * size,               # all-gather forward and backward, reduce-scatter
             "fsdp-grad-op": part * size + part * size,           # one all-gather, reduce-scatter
             "single": 0.0}
    return moves[strategy]


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def rank_main(rank: int, port: int, names: list[str], steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        collective = TorchCollective("cpu")
        results = [run_config(name, CONFIGS[name], steps, collective) for name in names]
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Settings:
    steps: int = option(12, "measured steps per configuration")
    configs: tuple[str, ...] = option(tuple(CONFIGS), "comma-separated subset of: " + ", ".join(CONFIGS),
                                      parse=comma_list)
    optimizers: str | None = option(None, "instead of the strategy rows, AdamW vs GaLore rows on a full-parameter "
                                    "MODEL, e.g. smollm2-135m (bench/optimizer_rows.py)", metavar="MODEL")
    optimizer_steps: int = option(4, "optimiser steps per --optimizers row")
    optimizer_rows: tuple[str, ...] = option(("adamw", "galore-a0.25", "galore-a1"),
                                             "comma-separated --optimizers rows (bench/optimizer_rows.py ROWS)",
                                             parse=comma_list)

    def __post_init__(self) -> None:
        unknown = [n for n in self.configs if n not in CONFIGS]
        if unknown or self.steps < 1 or self.optimizer_steps < 1:
            raise ValueError(f"unknown --configs {unknown} (or --steps or --optimizer-steps < 1)")


def run(s: Settings, ctx: Run) -> int:
    if s.optimizers:
        return optimizer_report(s.optimizers, s.optimizer_steps, list(s.optimizer_rows), ctx)
    single = run_config("1 rank", ParallelSettings(), s.steps, SingleProcess())
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(free_port(), list(s.configs), s.steps, out), nprocs=2)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    rows = []
    for first, second in zip(*ranks):
        rows.append({**first, "peak_rss_mb_per_rank": [first["peak_rss_mb"], second["peak_rss_mb"]],
                     "scaling_efficiency": first["tokens_per_s"] / (2 * single["tokens_per_s"])})
    report = {"model": "tiny-qwen2 full-parameter", "steps": s.steps, "world_size": 2, "backend": "gloo (CPU)",
              "single_rank": single, "configs": rows, "cpus": os.cpu_count()}
    ctx.write(report)
    print(format_table(["config", "strategy", "tokens/s", "scaling", "RSS MB r0/r1", "MB/step", "held-out loss",
                        "grad cos"],
                       [[r["config"], r["strategy"], f"{r['tokens_per_s']:.0f}", f"{r['scaling_efficiency']:.2f}",
                         "/".join(f"{m:.0f}" for m in r["peak_rss_mb_per_rank"]),
                         f"{r['bytes_per_step'] / 2**20:.2f}{'' if r['bytes_measured'] else '*'}",
                         f"{r['heldout_loss']:.3f}",
                         "" if r["grad_cosine"] is None else f"{r['grad_cosine']:.3f}"] for r in rows]))
    print(f"1 rank: {single['tokens_per_s']:.0f} tokens/s, held-out loss {single['heldout_loss']:.3f}, "
          f"RSS {single['peak_rss_mb']:.0f} MB; * = computed from the collectives, not measured")
    print(f"results in {ctx.out}")
    return 0


def optimizer_report(model: str, steps: int, names: list[str], ctx: Run) -> int:
    """AdamW vs GaLore rows, written into the results under "optimizers" (the strategy rows are kept, and
    rows of other names already there too, so two processes can fill one table)."""
    from bench.optimizer_rows import OPTIMIZER_HEADERS, ROWS, optimizer_rows, optimizer_table

    if any(name not in ROWS for name in names):
        print(f"error: --optimizer-rows must name rows of {', '.join(ROWS)}", file=sys.stderr)
        return 2
    rows = optimizer_rows(model, steps, names)
    report = json.loads(ctx.out.read_text()) if ctx.out.is_file() else {}
    kept = [r for r in report.get("optimizers", {}).get("rows", []) if r["optimizer"] not in names
            and report["optimizers"].get("model") == f"{model} full-parameter" and report["optimizers"]["steps"] == steps]
    report["optimizers"] = {"model": f"{model} full-parameter", "steps": steps, "rows": kept + rows,
                            "stamp": ctx.stamp()}
    ctx.write(report)
    print(format_table(OPTIMIZER_HEADERS, optimizer_table(kept + rows)))
    return 0


BENCH = Bench("strategies", tags=("training",), settings=Settings, run=run, quick={"steps": 2},
              torch_threads=2)  # one rank alone may use both cores; two ranks get one each
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
