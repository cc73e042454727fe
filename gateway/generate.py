"""Answer one prompt with the base model, optionally with an adapter (an expert or the gateway)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from gateway.export import ExportError, merged_copy


def generate(
    base_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    tensors: Mapping[str, Tensor] | None = None,
    lora: Mapping[str, Any] | None = None,
    max_new_tokens: int = 64,
) -> str:
    """Greedy answer to `prompt` as the chat's user turn; only the new text is returned.

    With `tensors` (a PEFT adapter state dict) and its `lora` config, the adapter is merged into
    a copy of the base model first; `base_model` is never modified. To answer many prompts
    with one adapter, merge once with `gateway.export.merged_copy` and pass that model here
    with no adapter.
    """
    if (tensors is None) != (lora is None):
        raise ExportError("give both tensors and their lora config, or neither")
    if type(max_new_tokens) is not int or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    model = base_model if tensors is None or lora is None else merged_copy(base_model, tensors, lora)
    device = next(model.parameters()).device
    input_ids = torch.tensor([_prompt_ids(tokenizer, prompt)], dtype=torch.long, device=device)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=_stop_ids(model, tokenizer),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
        else tokenizer.eos_token_id,
    )
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            # GenerationMixin.generate; mypy resolves it through torch's Module.__getattr__ (a Tensor)
            output = model.generate(  # type: ignore[operator]
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    finally:
        model.train(was_training)
    return str(tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True))  # one sequence: a str


def _prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """The user turn plus the assistant header, as the workers format training examples."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt + "\n")["input_ids"]


def _stop_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """End of turn as the tokenizer says it, plus any the model's own generation config lists."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    if configured is None:
        configured = []
    elif isinstance(configured, int):
        configured = [configured]
    ids = [tokenizer.eos_token_id] + list(configured)
    return list(dict.fromkeys(i for i in ids if i is not None))
