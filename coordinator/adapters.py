"""Checks on the adapters, full weights and update payloads the coordinator accepts."""
from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch

from compression import Codec, wire
from compression.errors import CompressionError
from compression.registry import make_codec
from protocol.errors import BadRequest, InvalidPayload, InvalidUpdate
from protocol.schemas import RAW_CODEC, FullSpec, LoraSpec
from protocol.streaming import FileTensors, check_file, read_header
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


def check_full_weights(path: Path, full: FullSpec) -> Manifest:
    """Validate a full-parameter expert's initial weights (read in chunks); return their manifest.

    The manifest is the header's own (names, shapes); what is checked against the spec is that
    the weights are a whole model's (no LoRA factors) and hold exactly ``num_parameters`` values,
    so a worker that meant to send a LoRA adapter, or a truncated model, is refused at once.
    """
    manifest = read_header(path).manifest
    if not manifest:
        raise InvalidUpdate("the full-parameter weights have no tensors")
    lora = [name for name, _ in manifest if name.endswith(LORA_SUFFIXES)]
    if lora:
        raise InvalidUpdate(f"tensor {lora[0]!r} is a LoRA factor, but this expert is full-parameter "
                            "(kind 'full'); send the model's own weights, or create a LoRA expert")
    total = sum(math.prod(shape) for _, shape in manifest)
    if total != full.num_parameters:
        raise InvalidUpdate(f"the weights hold {total} parameters, but the spec says num_parameters "
                            f"{full.num_parameters}")
    check_file(path, manifest)
    return manifest


def check_update(path: Path, codec: str, codec_config: dict, manifest: Manifest) -> Mapping[str, torch.Tensor]:
    """Refuse (4xx) an update body that does not fit the expert; return its checked deltas.

    Raw bodies are checked in chunks and returned as a lazy per-tensor view of the file;
    compressed ones are decoded once (the caller takes their norm from what we return).
    """
    if codec == RAW_CODEC:
        _check_raw_config(codec_config)
        check_file(path, manifest)
        return FileTensors(path)
    return decode_update(path, codec, codec_config, manifest)


def stored_deltas(path: Path, codec: str, codec_config: dict, manifest: Manifest) -> Mapping[str, torch.Tensor]:
    """An accepted update's deltas for aggregation: raw ones read tensor by tensor from the blob."""
    if codec == RAW_CODEC:
        return FileTensors(path)
    return decode_update(path, codec, codec_config, manifest)


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


def _check_raw_config(codec_config: dict) -> None:
    if codec_config:
        raise BadRequest(f"codec {RAW_CODEC!r} takes no codec_config, got {codec_config!r}")


def _decode_raw(path: Path, codec_config: dict) -> StateDict:
    _check_raw_config(codec_config)
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


def non_finite_tensor(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first tensor holding Inf or NaN, or None if all are finite."""
    return next((name for name, t in tensors.items() if not bool(torch.isfinite(t).all())), None)
