"""LoRA update shapes of Qwen2 models, from their configs (no download), and random tensors of those shapes.

What the load generators push (bench/load.py, bench/loadgen.py, bench/scale.py, bench/hostile_backends.py):
real-sized updates without a model in memory.
"""
from __future__ import annotations

import torch

from protocol.tensors import Manifest

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Shapes only: Qwen2-0.5B's config.json (hidden 896, MLP 4864, 24 layers, 14 heads, 2 KV heads of 64)
# and the offline tiny-qwen2 preset (models/loading.py).
MODELS: dict[str, dict[str, int]] = {
    "qwen2-0.5b": {"hidden": 896, "intermediate": 4864, "layers": 24, "heads": 14, "kv_heads": 2},
    "tiny-qwen2": {"hidden": 128, "intermediate": 344, "layers": 2, "heads": 4, "kv_heads": 2},
}


def lora_manifest(model: str, rank: int) -> Manifest:
    """PEFT's tensor names and shapes for LoRA on all seven projections of a Qwen2 model."""
    c = MODELS[model]
    hidden, kv = c["hidden"], c["kv_heads"] * (c["hidden"] // c["heads"])
    dims = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
            "gate_proj": (hidden, c["intermediate"]), "up_proj": (hidden, c["intermediate"]),
            "down_proj": (c["intermediate"], hidden)}
    manifest = []
    for layer in range(c["layers"]):
        for proj in PROJECTIONS:
            part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            d_in, d_out = dims[proj]
            manifest += [(f"{key}.lora_A.weight", (rank, d_in)), (f"{key}.lora_B.weight", (d_out, rank))]
    return sorted(manifest)


def random_tensors(manifest: Manifest, seed: int, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * scale for name, shape in manifest}
