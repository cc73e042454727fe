"""Offline base-model presets: real Qwen2 models built from a config, no hub needed.

`tiny-qwen2` is a randomly initialised `Qwen2ForCausalLM` (hidden 128, 2 layers) with a byte-level
BPE tokenizer trained on the project's own sample data (data/*.jsonl). Both are deterministic:
the same corpus and settings give the same tokenizer and bit-identical weights in every process,
whatever the thread count, so two workers agree on the base-model fingerprint.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

from models.errors import ModelError

logger = logging.getLogger(__name__)

CORPUS_DIR = Path(__file__).resolve().parent.parent / "data"
CORPUS_FILES = ("docs_expert.jsonl", "python_expert.jsonl", "sql_expert.jsonl")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen2-Instruct's ChatML template: a default system turn, then <|im_start|>role\ncontent<|im_end|>\n.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class PresetError(ModelError):
    """A preset cannot be built (unknown name, missing corpus)."""


@dataclass(frozen=True)
class TinyQwen2Preset:
    """Shape of a small Qwen2 model and its tokenizer; every field feeds the fingerprint."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_hidden_layers: int = 2
    """Number of decoder layers."""
    num_attention_heads: int = 4
    """Query heads per layer."""
    num_key_value_heads: int = 2
    """Key/value heads per layer (grouped-query attention)."""
    intermediate_size: int = 344
    """Width of the SwiGLU MLP."""
    max_position_embeddings: int = 512
    """Longest sequence the rotary embedding is configured for."""
    vocab_size: int = 3000
    """Target size of the BPE vocabulary, special tokens included."""
    init_std: float = 0.1
    """Std of the normal weight init: about 1/sqrt(hidden_size), not Qwen2's 0.02.

    With 0.02 the frozen random embeddings cap any logit near 2.6, so LoRA alone can barely move
    the loss (8.0 -> 7.6 in 30 steps on python_expert); with 0.1 it reaches ~5.1.
    """
    seed: int = 0
    """Seed for the weight initialisation."""


PRESETS: dict[str, TinyQwen2Preset] = {"tiny-qwen2": TinyQwen2Preset()}

# A random tiny model needs a far larger LoRA step than a pretrained one (2e-4): measured on the
# sample data, 1e-2 takes held-out loss from ~8.6 to ~2.5-4.8 in 40 s of demo training.
# The pretrained SmolLM2-135M (models.pretrained) on DS-1000 pandas, batch 4 x 128 tokens: held-out loss
# 2.06 -> 1.72 after 8 steps at 1e-3, against 1.92 at 2e-4 (and 1.67 after 12 steps at 1e-3).
RECOMMENDED_LR: dict[str, float] = {"tiny-qwen2": 1e-2, "smollm2-135m": 1e-3}


def corpus_texts(corpus_dir: Path = CORPUS_DIR) -> list[str]:
    """Prompts and answers of the sample datasets, in a fixed order, plus the default system prompt."""
    texts = [DEFAULT_SYSTEM_PROMPT]
    for name in CORPUS_FILES:
        path = corpus_dir / name
        if not path.is_file():
            raise PresetError(f"tokenizer corpus file {path} is missing; regenerate it with "
                              f"`python data/make_samples.py`")
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                texts += [record["prompt"], record["reference_code"]]
    return texts


@functools.lru_cache(maxsize=4)
def _trained_tokenizer(corpus_key: str, vocab_size: int, corpus_dir: Path) -> PreTrainedTokenizerBase:
    # corpus_key (a hash of the texts) is part of the cache key so an edited corpus retrains.
    texts = corpus_texts(corpus_dir)
    base = Qwen2Tokenizer()  # byte-level BPE with Qwen2's pre-tokenizer and no merges yet
    tokenizer = base.train_new_from_iterator([texts], vocab_size=vocab_size, new_special_tokens=list(SPECIAL_TOKENS),
                                             show_progress=False)
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


def build_tokenizer(preset: TinyQwen2Preset, corpus_dir: Path = CORPUS_DIR) -> PreTrainedTokenizerBase:
    """The preset's tokenizer (trained once per process, then copied)."""
    key = hashlib.sha256("\0".join(corpus_texts(corpus_dir)).encode("utf-8")).hexdigest()
    return copy.deepcopy(_trained_tokenizer(key, preset.vocab_size, corpus_dir))


def tokenizer_sha256(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash of the full tokenizer definition (vocabulary, merges, pipeline) plus chat template."""
    definition = tokenizer.backend_tokenizer.to_str() + "\0" + (tokenizer.chat_template or "")
    return hashlib.sha256(definition.encode("utf-8")).hexdigest()


@contextlib.contextmanager
def _float32_cpu_init(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG for the block without disturbing the caller's RNG or default dtype."""
    previous_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.set_default_dtype(torch.float32)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            torch.set_default_dtype(previous_dtype)


def build_preset(name: str, corpus_dir: Path = CORPUS_DIR) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Build a registered preset: (model in eval mode, float32 on CPU; tokenizer)."""
    if name not in PRESETS:
        raise PresetError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    preset = PRESETS[name]
    tokenizer = build_tokenizer(preset, corpus_dir)
    # Extra keys land in config.to_dict(), so the fingerprint covers the tokenizer and recipe too.
    extra: dict[str, Any] = {"fedmoe_preset": name, "fedmoe_preset_settings": asdict(preset),
                             "fedmoe_tokenizer_sha256": tokenizer_sha256(tokenizer)}
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=preset.hidden_size, intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers, num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads, max_position_embeddings=preset.max_position_embeddings,
        max_window_layers=preset.num_hidden_layers, tie_word_embeddings=True, initializer_range=preset.init_std,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        architectures=["Qwen2ForCausalLM"], **extra,
    )
    with _float32_cpu_init(preset.seed):
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    logger.info("built preset %s: %d parameters, vocabulary %d", name, model.num_parameters(), len(tokenizer))
    return model, tokenizer
