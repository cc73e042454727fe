"""What get_gateway_model.py does on this machine: pick an adapter, save it in a format, answer a prompt.

The script only parses flags and prints; these functions take plain values, so they are usable (and tested)
without a command line. The base model is loaded with models.loading, imported only when a format or an answer
needs the model itself.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from gateway.download import Adapter, fetch_expert, fetch_gateway, merge_experts
from protocol.client import CoordinatorClient
from protocol.files import write_atomically

if TYPE_CHECKING:
    from models.loading import BaseModel

FILE_FORMATS = {".npz": "npz", ".safetensors": "safetensors"}
"""File name suffix -> format of a single-file output."""
FORMATS = ("npz", "safetensors", "peft", "merged")


def choose_adapter(client: CoordinatorClient, expert: str | None, strategy: str | None,
                   strategy_config: dict[str, Any]) -> Adapter:
    """One expert's adapter, the experts merged here with `strategy`, or the coordinator's gateway."""
    if expert:
        return fetch_expert(client, expert)
    if strategy:
        return merge_experts(client, strategy, strategy_config)
    return fetch_gateway(client)


def output_format(path: Path, fmt: str | None) -> str:
    """`fmt`, or the format `path`'s suffix names."""
    if fmt:
        return fmt
    found = FILE_FORMATS.get(path.suffix.lower())
    if found is None:
        raise ValueError(f"--save-gateway: cannot tell the format from {str(path)!r}; use a .npz or "
                         f".safetensors name, or --format {{{','.join(FORMATS)}}}")
    return found


def save_adapter(adapter: Adapter, path: Path, fmt: str, *, overwrite: bool,
                 load_base: Callable[[], BaseModel]) -> None:
    """Write `adapter` to `path` as `fmt`; `load_base` is called only for formats that need the base model."""
    if not path.parent.is_dir():
        raise ValueError(f"--save-gateway: directory {str(path.parent)!r} does not exist")
    if fmt in FILE_FORMATS.values():
        from gateway.files import npz_bytes, safetensors_bytes

        if path.exists() and not overwrite:
            raise ValueError(f"--save-gateway: {str(path)!r} exists; pass --overwrite to replace it")
        write_atomically(path, (npz_bytes if fmt == "npz" else safetensors_bytes)(adapter.tensors, adapter.info))
        return
    from gateway.export import save_merged_model, save_peft_adapter

    if adapter.lora is None:  # a full-parameter expert, or a gateway averaged from them
        _save_full(adapter, path, fmt, overwrite, load_base)
    elif fmt == "peft":
        save_peft_adapter(path, adapter.tensors, adapter.lora, adapter.base_model["id"], overwrite=overwrite)
    else:
        base = load_base()
        save_merged_model(path, base.model, base.tokenizer, adapter.tensors, adapter.lora, overwrite=overwrite)


def _save_full(adapter: Adapter, path: Path, fmt: str, overwrite: bool, load_base: Callable[[], BaseModel]) -> None:
    from gateway.full import save_full_model

    if fmt == "peft":
        raise ValueError("--format peft: this is a full-parameter model (every weight, no LoRA factors), not a "
                         "PEFT adapter; use --format merged for a model directory, or a .safetensors/.npz file")
    base = load_base()
    save_full_model(path, base.model, base.tokenizer, adapter.tensors, overwrite=overwrite)


def load_matching_base(adapter: Adapter, model_id: str | None, use_huggingface: bool) -> BaseModel:
    """The base model `adapter` was trained from (or `model_id`), refused if its fingerprint differs."""
    from models.loading import ModelLoadError, load_base_model

    try:
        base = load_base_model(model_id or adapter.base_model["id"], use_huggingface=use_huggingface)
    except ModelLoadError as exc:
        raise ValueError(f"{exc} (or pass --base-model)") from None
    if base.fingerprint != adapter.base_model["fingerprint"]:
        raise ValueError(f"base model {base.model_id!r} is not the one the experts were trained from "
                         f"({adapter.base_model['id']!r}); fix --base-model")
    return base


def answer(adapter: Adapter, base: BaseModel, prompt: str, max_new_tokens: int) -> str:
    """`prompt` answered by the base model with `adapter` applied."""
    from gateway.generate import generate

    if adapter.lora is None:  # full-parameter weights: answer with the model holding them
        from gateway.full import with_full_weights

        return generate(with_full_weights(base.model, adapter.tensors), base.tokenizer, prompt,
                        max_new_tokens=max_new_tokens)
    return generate(base.model, base.tokenizer, prompt, adapter.tensors, adapter.lora, max_new_tokens)
