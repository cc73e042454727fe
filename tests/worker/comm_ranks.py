"""Two CPU ranks (gloo) training with each DDP comm hook; started by test_comm_hooks.py.

Per codec, rank 0 writes the --results step lines of three steps and its first-step gradients.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from tests.worker.strategy_ranks import TRAIN, examples
from worker.distributed import TorchCollective
from models.loading import load_base_model
from worker.step_metrics import StepLog
from worker.strategies import ParallelSettings
from worker.trainer import LoraSettings, LoraTrainer

CODECS: dict[str, tuple[str, dict]] = {
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "powersgd": ("powersgd", {"matrix_approximation_rank": 2}),
    "int8": ("int8", {}),
    "topk": ("topk", {"ratio": 0.1}),
}


def run_codec(name: str, out: Path, collective: TorchCollective) -> None:
    codec, config = CODECS[name]
    log = StepLog(out / f"{name}.jsonl") if collective.is_primary else None
    trainer = LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(), TRAIN, examples(), collective=collective,
                          parallel=ParallelSettings(strategy="ddp", comm_compress=codec, comm_config=config),
                          step_log=log)
    trainer.train_steps(1)
    if collective.is_primary:
        grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        save_file(grads, out / f"{name}-grads.safetensors")
    trainer.train_steps(2)  # powersgd compresses from its third step (start_powerSGD_iter 2)


def main(rank: int, port: int, out: str, codecs: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        collective = TorchCollective("cpu")
        for name in codecs:
            run_codec(name, Path(out), collective)
        Path(out, f"rank{rank}.json").write_text(json.dumps(codecs))
    finally:
        dist.destroy_process_group()
