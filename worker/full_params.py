"""Full-parameter experts (``--lora-rank 0``): the expert is every weight of the model.

No adapter is attached; the trainer optimises ``model.named_parameters()`` directly and
federates them under those names. Tied weights (Qwen2's embedding and LM head when
``tie_word_embeddings``) appear once, as ``named_parameters`` lists them.
"""
from __future__ import annotations

from typing import Any

import torch


def trainable_weights(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every parameter of the model, made trainable; live views keyed by their module path."""
    weights = dict(model.named_parameters())
    for p in weights.values():
        p.requires_grad_(True)
    return weights


def full_expert_config(weights: dict[str, torch.nn.Parameter]) -> dict[str, Any]:
    """The ``kind``/``full`` part of the expert spec the coordinator checks the weights against."""
    return {"kind": "full", "full": {"num_parameters": sum(p.numel() for p in weights.values())}}
