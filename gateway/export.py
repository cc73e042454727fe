"""Export an adapter (an expert or the gateway) as a PEFT adapter directory or a merged model.

The adapter arrives as the project passes it everywhere: a PEFT state dict (keys as
`peft.get_peft_model_state_dict` names them, `base_model.model.<module>.lora_A.weight`, no
adapter name) plus its lora config `{"rank", "alpha", "target_modules"}`. PEFT 0.21 saves
exactly those keys in `adapter_model.safetensors` and inserts the adapter name itself when it
loads them (peft/utils/save_and_load.py), so the tensors are written as they are.

Both exports are written into a temporary directory next to the target and renamed into place,
so a crash leaves either the old directory or the complete new one, never half an export.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import save_file
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from gateway.errors import GatewayError, MergeError
from gateway.lora import split_modules

logger = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class ExportError(GatewayError, ValueError):
    """An adapter or its lora config cannot be exported as given."""

    code = "invalid_export"


class ExportExistsError(GatewayError, FileExistsError):
    """The export directory already holds files and overwriting was not asked for."""

    code = "export_exists"


def check_adapter(tensors: Mapping[str, Tensor], lora: Mapping[str, Any]) -> LoraConfig:
    """Check the adapter against its lora config; the PEFT LoraConfig that loads it.

    Raises ExportError naming the bad key or value.
    """
    rank, alpha, targets = _parse_lora(lora)
    try:
        modules = split_modules(dict(tensors), alpha=alpha, rank=rank)
    except MergeError as exc:
        raise ExportError(str(exc)) from None
    for prefix in modules:
        if not prefix.startswith(PEFT_PREFIX):
            raise ExportError(
                f"{prefix!r} does not start with {PEFT_PREFIX!r}; keys must be named as "
                "peft.get_peft_model_state_dict names them"
            )
        module = prefix[len(PEFT_PREFIX):]
        # PEFT's rule for a list of names: the module's full name or its dotted tail matches.
        if not any(module == t or module.endswith("." + t) for t in targets):
            raise ExportError(f"{prefix!r} adapts a module not in target_modules {targets}")
    for key, tensor in tensors.items():
        if not bool(torch.isfinite(tensor).all()):
            raise ExportError(f"{key!r} contains NaN or infinity")
    # peft annotates lora_alpha as int; a float alpha works (the scale is alpha / r)
    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, bias="none",  # type: ignore[arg-type]
                      task_type="CAUSAL_LM")


def _parse_lora(lora: Mapping[str, Any]) -> tuple[int, float, list[str]]:
    if not isinstance(lora, Mapping):
        raise ExportError(f"lora must be a dict with rank, alpha, target_modules; got {lora!r}")
    missing = [key for key in ("rank", "alpha", "target_modules") if key not in lora]
    if missing:
        raise ExportError(f"lora config lacks {', '.join(missing)}; got {dict(lora)!r}")
    rank, alpha, targets = lora["rank"], lora["alpha"], lora["target_modules"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ExportError(f"lora rank must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) \
            or not 0 < alpha < math.inf:
        raise ExportError(f"lora alpha must be a positive finite number, got {alpha!r}")
    if isinstance(targets, str) or not isinstance(targets, (list, tuple)) or not targets \
            or not all(isinstance(t, str) and t for t in targets):
        raise ExportError(
            f"lora target_modules must be a non-empty list of module names, got {targets!r}"
        )
    return rank, float(alpha), list(targets)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars ("Writing model shards") and no deprecation notice that is not the user's to act on.

    peft asks transformers for ``is_gradient_checkpointing``, which transformers 5 deprecates with a
    FutureWarning on every export and --generate; the bars are noise in a command whose output is one line.
    """
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def attach_adapter(
    model: PreTrainedModel, tensors: Mapping[str, Tensor], lora: Mapping[str, Any]
) -> PeftModel:
    """Wrap `model` IN PLACE in PEFT with the adapter loaded; pass a copy to keep the original."""
    config = check_adapter(tensors, lora)
    config.init_lora_weights = False  # skip the random init: every weight is loaded next
    with quiet_transformers():
        peft_model = get_peft_model(model, config)
    result = cast(Any, set_peft_model_state_dict(peft_model, dict(tensors)))  # peft types it a bare namedtuple
    # PEFT reports every non-LoRA weight as missing too; only missing LoRA factors matter.
    missing = [key for key in result.missing_keys if ".lora_" in key]
    if result.unexpected_keys or missing:
        raise ExportError(
            f"adapter does not fit this model: unexpected keys {result.unexpected_keys[:3]}, "
            f"missing LoRA keys {missing[:3]}; is it for this base model and target_modules?"
        )
    return peft_model.eval()


def merged_copy(
    base_model: PreTrainedModel, tensors: Mapping[str, Tensor], lora: Mapping[str, Any]
) -> PreTrainedModel:
    """A deep copy of `base_model` with the adapter folded into its weights (W + B @ A * s)."""
    with torch.no_grad():
        return attach_adapter(copy.deepcopy(base_model), tensors, lora).merge_and_unload().eval()


def save_peft_adapter(
    directory: str | os.PathLike,
    tensors: Mapping[str, Tensor],
    lora: Mapping[str, Any],
    base_model_id: str,
    *,
    overwrite: bool = False,
) -> Path:
    """Write a directory that `PeftModel.from_pretrained(base_model, directory)` loads.

    `base_model_id` goes into adapter_config.json (`base_model_name_or_path`) so that
    `AutoPeftModelForCausalLM` can find the base model.
    """
    config = check_adapter(tensors, lora)
    config.base_model_name_or_path = base_model_id
    config.inference_mode = True
    weights = {key: t.detach().to("cpu").contiguous() for key, t in tensors.items()}
    with _atomic_directory(directory, overwrite) as tmp:
        save_file(weights, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))
    logger.info("saved PEFT adapter (%d tensors) to %s", len(weights), directory)
    return Path(directory)


def save_merged_model(
    directory: str | os.PathLike,
    base_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tensors: Mapping[str, Tensor],
    lora: Mapping[str, Any],
    *,
    overwrite: bool = False,
) -> Path:
    """Write the base model with the adapter merged in (safetensors) plus the tokenizer.

    `AutoModelForCausalLM.from_pretrained(directory)` and `AutoTokenizer.from_pretrained(directory)`
    load it with no PEFT needed. `base_model` itself is left untouched.
    """
    check_adapter(tensors, lora)
    _refuse_existing(Path(directory), overwrite)  # fail before the (slow) merge and save
    merged = merged_copy(base_model, tensors, lora)
    with _atomic_directory(directory, overwrite) as tmp, quiet_transformers():
        merged.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    logger.info("saved merged model to %s", directory)
    return Path(directory)


@contextlib.contextmanager
def _atomic_directory(directory: str | os.PathLike, overwrite: bool) -> Iterator[Path]:
    """Yield a fresh temp dir beside `directory`; on success fsync it and rename it into place."""
    target = Path(directory)
    _refuse_existing(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        _replace_directory(tmp, target, overwrite)
        _fsync_path(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename


def _refuse_existing(target: Path, overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise ExportExistsError(f"{target} exists and is not a directory; choose another path")
    if not overwrite and target.is_dir() and any(target.iterdir()):
        raise ExportExistsError(
            f"{target} already exists and is not empty; pass overwrite=True to replace it"
        )


def _replace_directory(tmp: Path, target: Path, overwrite: bool) -> None:
    """Rename tmp to target; an existing target is moved aside first and removed after."""
    _refuse_existing(target, overwrite)  # again: the directory may have appeared meanwhile
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    if not target.exists():
        os.rename(tmp, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    os.rename(target, old / "previous")
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old / "previous", target)  # put the previous export back
        old.rmdir()
        raise
    shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        _fsync_path(path)
    _fsync_path(root)


def _fsync_path(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() and hasattr(os, "O_DIRECTORY") else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
