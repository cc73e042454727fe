"""One rank of a two-process data-parallel worker, started by test_data_parallel.py as torchrun would.

Joins the coordinator's expert, then twice: trains two steps (saving the first step's gradients)
and syncs. After joining and after each sync it saves its adapter, so the test can compare ranks.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from protocol.schemas import RAW_CODEC
from worker.data import sample_dataset_path
from worker.distributed import process_group
from worker.encoding import CompressionSettings
from worker.federation import SyncSettings
from worker.runner import WorkerConfig, build_worker
from worker.strategies import ParallelSettings
from worker.trainer import LoraSettings, TrainSettings

# 7 examples per step: rank 0 trains on rows 0, 2, 4, 6 and rank 1 on rows 1, 3, 5, each in two micro-batches.
TRAIN = TrainSettings(lr=1e-2, batch_size=7, max_seq_len=128, seed=0, grad_accum=2)
SPECIALTY = "sql_expert"


def main(url: str, out: Path, strategy: str = "ddp") -> None:
    torch.set_num_threads(1)
    config = WorkerConfig(coordinator_url=url, dataset=sample_dataset_path(SPECIALTY), base_model="tiny-qwen2",
                          sync=SyncSettings(specialty=SPECIALTY, worker_id="dp-worker"), lora=LoraSettings(),
                          train=TRAIN, device="cpu", parallel=ParallelSettings(strategy=strategy),
                          # lossless pushes: the test compares the pushed update with one process's step
                          compression=CompressionSettings(RAW_CODEC))
    with process_group("cpu") as (collective, device):
        worker, trainer, _ = build_worker(config, collective, device)
        rank = collective.rank
        worker.joining.join()
        save_file(trainer.gathered_state(), out / f"rank{rank}-join.safetensors")
        for sync in range(2):
            worker.interval.add(trainer.train_steps(1))
            if sync == 0:
                grads = {name: full(p.grad).detach().clone().contiguous()
                         for name, p in trainer.model.named_parameters() if p.requires_grad}
                save_file(grads, out / f"rank{rank}-grads.safetensors")
            worker.interval.add(trainer.train_steps(1))
            worker.sync()
            save_file(trainer.gathered_state(), out / f"rank{rank}-sync{sync}.safetensors")


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A FSDP gradient shard gathered (every rank calls this in the same order)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
