"""Held-out loss of a base model with an adapter (an expert, the gateway) applied, for benches and tests.

It joins a gateway piece (``gateway.export.attach_adapter``) to a worker piece (``worker.trainer.evaluate_loss``),
so it lives above both: the worker itself never evaluates an adapter it did not train.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gateway.export import attach_adapter
from models.loading import BaseModel
from protocol.tensors import StateDict
from worker.data import Example
from worker.trainer import evaluate_loss


def adapter_loss(base: BaseModel, examples: Sequence[Example], adapter: StateDict | None = None,
                 lora: Mapping[str, Any] | None = None, max_seq_len: int = 256) -> float:
    """Mean answer-token loss on ``examples``; ``adapter=None`` measures the base model itself.

    ``lora`` is the adapter's {"rank", "alpha", "target_modules"} as the coordinator reports it.
    The base model is copied, so ``base`` stays clean for the next call.
    """
    return evaluate_loss(with_adapter(base, adapter, lora), base.tokenizer, examples, max_seq_len=max_seq_len)


def with_adapter(base: BaseModel, adapter: Mapping[str, torch.Tensor] | None,
                 lora: Mapping[str, Any] | None) -> torch.nn.Module:
    """A copy of the base model with ``adapter`` attached, in eval mode (``adapter=None``: the base model itself)."""
    model: torch.nn.Module = base.model
    if adapter is not None:
        if lora is None:
            raise ValueError("an adapter needs its lora config (rank, alpha, target_modules)")
        model = attach_adapter(copy.deepcopy(base.model), dict(adapter), dict(lora))
    return model.eval()
