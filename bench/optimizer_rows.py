"""The optimiser rows of bench/strategies.py: AdamW against GaLore on one full-parameter expert.

A fixed number of optimiser steps (learning claims count steps, not seconds) on DS-1000 pandas
problems, one process, then the held-out loss on the shipped held-out pandas problems, and the
bytes the optimiser's state takes (Adam moments, GaLore's projections). The model defaults to the
pretrained smollm2-135m (`make smollm2`); tiny-qwen2 makes it a smoke test.

    python -m bench.strategies --optimizers smollm2-135m --optimizer-steps 4
    python -m bench.strategies --optimizers smollm2-135m --optimizer-rows galore-a1   # one row (two processes
                                                                                     # may fill the rows at once)
"""
from __future__ import annotations

import time
from typing import Any

import torch

from bench.common import DS1000_DIR
from worker.data import load_examples
from worker.galore import GaLoreSettings, state_bytes
from models.loading import load_base_model
from worker.optimizers import OptimizerSettings
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

LR = 3e-5
"""A full-parameter fine-tuning step size for a 135M model; the same for every row."""
HELDOUT = 16
"""Held-out pandas problems scored (of 33): two forward passes per row on a 135M model."""
ROWS: dict[str, OptimizerSettings] = {
    "adamw": OptimizerSettings("adamw"),
    "galore-a0.25": OptimizerSettings("galore", GaLoreSettings(rank=128, update_interval=200, scale=0.25)),
    "galore-a1": OptimizerSettings("galore", GaLoreSettings(rank=128, update_interval=200, scale=1.0)),
}


def optimizer_row(name: str, optimizer: OptimizerSettings, model: str, steps: int) -> dict[str, Any]:
    train = load_examples(DS1000_DIR / "train" / "pandas_expert.jsonl")
    heldout = load_examples(DS1000_DIR / "heldout" / "pandas_expert.jsonl")[:HELDOUT]
    settings = TrainSettings(lr=LR, batch_size=4, max_seq_len=128, seed=0, optimizer=optimizer)
    trainer = LoraTrainer(load_base_model(model), LoraSettings(rank=0), settings, train)
    before = trainer.eval_loss(heldout)
    started = time.perf_counter()
    stats = trainer.train_steps(steps)
    seconds = time.perf_counter() - started
    numel = sum(p.numel() for p in trainer.model.parameters())
    return {"optimizer": name, "settings": {"name": optimizer.name, **vars(optimizer.galore)},
            "steps": steps, "heldout_loss_before": before, "heldout_loss_after": trainer.eval_loss(heldout),
            "optimizer_state_mb": state_bytes(trainer._optimizer) / 2**20,
            "adamw_state_mb_for_same_params": 8 * numel / 2**20, "tokens_per_s": stats.tokens / seconds,
            "train_loss": stats.loss}


def optimizer_rows(model: str, steps: int, names: list[str]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return [optimizer_row(name, ROWS[name], model, steps) for name in names]


def optimizer_table(rows: list[dict[str, Any]]) -> list[list[str]]:
    return [[r["optimizer"], f"{r['optimizer_state_mb']:.0f}", f"{r['heldout_loss_before']:.3f}",
             f"{r['heldout_loss_after']:.3f}", f"{r['tokens_per_s']:.0f}"] for r in rows]


OPTIMIZER_HEADERS = ["optimizer", "state MB", "held-out before", "held-out after", "tokens/s"]
