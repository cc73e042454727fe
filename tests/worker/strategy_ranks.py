"""Two CPU ranks (gloo) training the same batches under each strategy; started by test_strategies.py.

Each rank runs every case of CASES in one process group, and rank 0 saves per case: the losses of
two steps, the full first-step gradients and the full adapter after two steps; then it checks that
rank 0's weights reach every rank's shards.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from worker.data import load_examples, sample_dataset_path, split_examples
from worker.distributed import TorchCollective
from models.loading import load_base_model
from worker.strategies import ParallelSettings
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

# 7 examples per step: rank 0 trains on rows 0, 2, 4, 6 and rank 1 on rows 1, 3, 5, each in two micro-batches.
TRAIN = TrainSettings(lr=1e-2, batch_size=7, max_seq_len=96, seed=0, grad_accum=2)
CASES: dict[str, tuple[int, ParallelSettings, dict]] = {
    "ddp-lora": (8, ParallelSettings(strategy="ddp"), {}),
    "fsdp-lora": (8, ParallelSettings(strategy="fsdp"), {}),
    "fsdp-grad-op-lora-checkpointing": (8, ParallelSettings(strategy="fsdp-grad-op"),
                                        {"gradient_checkpointing": True}),
    "fsdp-full": (0, ParallelSettings(strategy="fsdp"), {}),
    "fsdp-offload-full": (0, ParallelSettings(strategy="fsdp", cpu_offload=True), {}),
    "ddp-full-bf16": (0, ParallelSettings(strategy="ddp"), {"precision": "bf16"}),
    "fsdp-lora-bf16": (8, ParallelSettings(strategy="fsdp"), {"precision": "bf16"}),
}


def train_settings(extra: dict) -> TrainSettings:
    return TrainSettings(**{**TRAIN.__dict__, **extra})


def examples():
    return split_examples(load_examples(sample_dataset_path("python_expert")))[0]


def full_grads(trainer: LoraTrainer) -> dict[str, torch.Tensor]:
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    out = {}
    for p in trainer.model.parameters():
        if p.requires_grad and p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[names[id(p)]] = g.detach().float().clone().contiguous()
    return out


def run_case(name: str, out: Path, collective: TorchCollective) -> dict:
    lora_rank, parallel, extra = CASES[name]
    trainer = LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(rank=lora_rank), train_settings(extra),
                          examples(), collective=collective, parallel=parallel)
    losses = [trainer.train_steps(1).loss]
    grads = full_grads(trainer)
    losses.append(trainer.train_steps(1).loss)
    state = trainer.gathered_state()
    report = {"strategy": trainer.strategy, "sharded": trainer.sharded, "losses": losses}
    if collective.rank == 0:
        assert torch.equal(trainer.adapter_state()[next(iter(state))], state[next(iter(state))])
        save_file(grads, out / f"{name}-grads.safetensors")
        save_file(state, out / f"{name}-state.safetensors")
        trainer.load_adapter_state({k: v + 1.0 for k, v in state.items()})  # as a pull on rank 0 would
    else:
        try:
            trainer.adapter_state()
            report["adapter_state_on_rank1"] = "returned" if trainer.sharded else "ok"
        except RuntimeError:
            report["adapter_state_on_rank1"] = "refused"
    trainer.share_primary_weights()
    shared = trainer.gathered_state()
    report["shared_is_rank0_plus_one"] = all(bool(torch.allclose(shared[k], state[k] + 1.0)) for k in state)
    return report


def main(rank: int, port: int, out: str, cases: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        collective = TorchCollective("cpu")
        reports = {name: run_case(name, Path(out), collective) for name in cases}
        Path(out, f"rank{rank}.json").write_text(json.dumps(reports))
    finally:
        dist.destroy_process_group()


def profile_main(rank: int, port: int, out: str) -> None:
    """Profile two steps (after one warm-up) under ddp and then fsdp; traces in out/<strategy>/."""
    from worker.profiling import ProfileSettings, StepProfiler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        collective = TorchCollective("cpu")
        for strategy in ("ddp", "fsdp"):
            trainer = LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(rank=0), TRAIN, examples(),
                                  collective=collective, parallel=ParallelSettings(strategy=strategy))
            trainer.profiler = StepProfiler(ProfileSettings(Path(out) / strategy, steps=2), rank)
            trainer.train_steps(4)  # warm-up, two profiled, one after
    finally:
        dist.destroy_process_group()
