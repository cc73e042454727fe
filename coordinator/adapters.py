"""Checks on the LoRA adapters and update payloads the coordinator accepts."""
from __future__ import annotations

from pathlib import Path

import torch

from compression import Codec, wire
from compression.errors import CompressionError
from compression.registry import make_codec
from protocol.errors import BadRequest, InvalidPayload, InvalidUpdate
from protocol.schemas import RAW_CODEC, LoraSpec
from protocol.tensors import Manifest, StateDict, check_against_manifest, load_file, manifest_of

LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def check_lora_adapter(tensors: StateDict, lora: LoraSpec) -> Manifest:
    """Validate an initial adapter against its LoRA spec; return its manifest."""
    if not tensors:
        raise InvalidUpdate("the adapter has no tensors")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        suffix = next((s for s in LORA_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            raise InvalidUpdate(f"tensor {name!r} is not a LoRA factor (names end in .lora_A.weight "
                                "or .lora_B.weight)")
        modules.setdefault(name[: -len(suffix)], {})[suffix] = t
    for module, factors in modules.items():
        if len(factors) != 2:
            raise InvalidUpdate(f"module {module!r} lacks its lora_A or lora_B factor")
        a, b = factors[".lora_A.weight"], factors[".lora_B.weight"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != lora.rank or b.shape[1] != lora.rank:
            raise InvalidUpdate(f"module {module!r}: lora_A {list(a.shape)} and lora_B {list(b.shape)} "
                                f"do not have rank {lora.rank}")
        if not any(module.endswith("." + m) or module == m for m in lora.target_modules):
            raise InvalidUpdate(f"module {module!r} is not one of target_modules {list(lora.target_modules)}")
    manifest = manifest_of(tensors)
    check_against_manifest(tensors, manifest)
    return manifest


def decode_update(path: Path, codec: str, codec_config: dict, manifest: Manifest) -> StateDict:
    """Turn a received update body into checked float32 deltas, or raise a 4xx error.

    ``safetensors`` bodies are plain tensors; any other codec name is a
    ``compression`` spec (e.g. ``topk+int8``) whose payload is decoded against
    the expert's manifest, so its size can never exceed the expert's.
    """
    tensors = _decode_raw(path, codec_config) if codec == RAW_CODEC else _decode_compressed(
        path, codec, codec_config, manifest)
    check_against_manifest(tensors, manifest)
    return tensors


def _decode_raw(path: Path, codec_config: dict) -> StateDict:
    if codec_config:
        raise BadRequest(f"codec {RAW_CODEC!r} takes no codec_config, got {codec_config!r}")
    try:
        return load_file(path)
    except InvalidPayload as exc:
        raise InvalidPayload("update body is not a valid safetensors file: "
                             + str(exc).split(": ", 1)[-1]) from None


def make_codec_or_400(codec: str, codec_config: dict) -> Codec:
    try:
        return make_codec(codec, codec_config)
    except CompressionError as exc:
        raise BadRequest(f"codec {codec!r}: {exc} (or {RAW_CODEC!r} for uncompressed tensors)") from None


def _decode_compressed(path: Path, codec: str, codec_config: dict, manifest: Manifest) -> StateDict:
    decoder = make_codec_or_400(codec, codec_config)
    try:
        return wire.decode_update(path.read_bytes(), manifest, decoder)
    except CompressionError as exc:
        raise InvalidPayload(f"update body is not a valid {codec!r} payload for this expert: {exc}") from None
