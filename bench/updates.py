"""Small real LoRA adapters, expert specs and update metadata: what the robustness benches push at a coordinator.

The tests push the same (tests/helpers.py takes them from here: tests may use bench, bench never uses tests).
"""
from __future__ import annotations

import uuid
from typing import Any

import torch

FINGERPRINT = "ab" * 32
MODULES = ("q_proj", "v_proj")


def module_key(layer: int, proj: str) -> str:
    return f"base_model.model.model.layers.{layer}.self_attn.{proj}"


def make_adapter(rank: int = 2, seed: int = 0, layers: int = 2, d_in: int = 6, d_out: int = 5,
                 modules: tuple[str, ...] = MODULES) -> dict[str, torch.Tensor]:
    """A LoRA adapter state dict shaped like PEFT's, with random (non-zero) A and B."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for proj in modules:
            tensors[f"{module_key(layer, proj)}.lora_A.weight"] = torch.randn(rank, d_in, generator=g)
            tensors[f"{module_key(layer, proj)}.lora_B.weight"] = torch.randn(d_out, rank, generator=g)
    return tensors


def random_like(tensors: dict[str, torch.Tensor], seed: int, scale: float = 0.1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * scale for k, v in tensors.items()}


def expert_spec(rank: int = 2, alpha: float = 4.0, fingerprint: str = FINGERPRINT,
                modules: tuple[str, ...] = MODULES) -> dict[str, Any]:
    return {"lora": {"rank": rank, "alpha": alpha, "target_modules": list(modules)},
            "base_model": {"id": "tiny-test", "fingerprint": fingerprint}}


def update_meta(base_version: int = 0, num_samples: int = 10, **extra: Any) -> dict[str, Any]:
    return {"update_id": uuid.uuid4().hex, "base_version": base_version, "num_samples": num_samples,
            "train_loss": 1.5, **extra}
