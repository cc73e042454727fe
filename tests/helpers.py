"""Small real objects the tests share: LoRA adapters and raw HTTP calls."""
from __future__ import annotations

import json
import uuid
from typing import Any

import torch

from protocol.schemas import EXPERT_HEADER, UPDATE_HEADER
from protocol.tensors import dumps

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


def put_expert(client, name: str, tensors, spec: dict[str, Any] | None = None):
    """PUT an expert through a Flask test client."""
    return client.put(f"/api/v1/experts/{name}", data=dumps(tensors),
                      headers={EXPERT_HEADER: json.dumps(spec or expert_spec())})


def push(client, name: str, delta, meta: dict[str, Any] | None = None, body: bytes | None = None):
    """POST an update through a Flask test client."""
    return client.post(f"/api/v1/experts/{name}/updates", data=dumps(delta) if body is None else body,
                       headers={UPDATE_HEADER: json.dumps(meta or update_meta())})
