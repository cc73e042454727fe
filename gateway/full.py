"""Full-parameter experts outside the coordinator: a model with an expert's weights, exported.

A full expert (or a gateway averaged from full experts) is every weight of the base model,
keyed as ``model.named_parameters()`` names them. It has no LoRA factors, so it cannot be a
PEFT adapter directory; as ``--format merged`` it is the base model with its weights replaced.
"""
from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gateway.export import ExportError, _atomic_directory, _refuse_existing, quiet_transformers

logger = logging.getLogger(__name__)


def with_full_weights(base_model: PreTrainedModel, tensors: Mapping[str, Tensor]) -> PreTrainedModel:
    """A deep copy of ``base_model`` holding the expert's weights; ExportError if they do not fit."""
    params = dict(base_model.named_parameters())
    missing, unexpected = sorted(params.keys() - tensors.keys()), sorted(tensors.keys() - params.keys())
    if missing or unexpected:
        raise ExportError(f"full-parameter weights do not fit this base model: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}; is --base-model the one the expert was trained from?")
    for name, p in params.items():
        if tuple(tensors[name].shape) != tuple(p.shape):
            raise ExportError(f"weight {name!r} has shape {list(tensors[name].shape)}, the base model's is "
                              f"{list(p.shape)}")
    model = copy.deepcopy(base_model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[name])
    return model.eval()


def save_full_model(directory: str | os.PathLike, base_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                    tensors: Mapping[str, Tensor], *, overwrite: bool = False) -> Path:
    """Write a model directory ``AutoModelForCausalLM.from_pretrained`` loads, never half-written."""
    _refuse_existing(Path(directory), overwrite)
    model = with_full_weights(base_model, tensors)
    with _atomic_directory(directory, overwrite) as tmp, quiet_transformers():
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    logger.info("saved full-parameter model to %s", directory)
    return Path(directory)
