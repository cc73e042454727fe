"""Tensors as bytes: safetensors only, strictly parsed. Never pickle.

A pickle file, a truncated file or a header that lies all fail in the
safetensors parser (written in Rust, bounds-checked), which we turn into
``InvalidPayload``.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save
from safetensors.torch import save_file as _st_save_file

from protocol.errors import InvalidPayload, InvalidUpdate
from protocol.schemas import is_finite_number  # noqa: F401 - re-exported for callers of the old home

StateDict = dict[str, torch.Tensor]
Manifest = list[tuple[str, tuple[int, ...]]]


def dumps(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialise tensors to safetensors bytes."""
    return _st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=dict(metadata or {}))


def loads(data: bytes) -> StateDict:
    """Parse safetensors bytes; anything else raises ``InvalidPayload``."""
    try:
        return _st_load(bytes(data))
    except (SafetensorError, ValueError, TypeError) as exc:
        raise InvalidPayload(f"body is not a valid safetensors file: {exc}") from None


def save_file(tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str] | None = None) -> None:
    _st_save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=dict(metadata or {}))


def load_file(path: Path) -> StateDict:
    """Load a safetensors file (a stored blob or a user file) into CPU tensors."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except FileNotFoundError:  # not a bad payload: gone (e.g. a pruned version); callers decide
        raise
    except (SafetensorError, ValueError, OSError) as exc:
        # the file's name only: this message reaches HTTP clients, who must not see server paths
        raise InvalidPayload(f"{Path(path).name} is not a valid safetensors file: {exc}") from None


def manifest_of(tensors: Mapping[str, torch.Tensor]) -> Manifest:
    """Ordered (name, shape) pairs: what both sides know about an expert's tensors."""
    return [(name, tuple(tensors[name].shape)) for name in sorted(tensors)]


def manifest_to_json(manifest: Manifest) -> str:
    return json.dumps([[name, list(shape)] for name, shape in manifest])


def manifest_from_json(text: str) -> Manifest:
    return [(str(name), tuple(int(d) for d in shape)) for name, shape in json.loads(text)]


def check_against_manifest(tensors: Mapping[str, torch.Tensor], manifest: Manifest) -> None:
    """Raise ``InvalidUpdate`` unless names, shapes, dtype (float32) and finiteness all fit."""
    expected = dict(manifest)
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise InvalidUpdate(
            f"tensor names do not match the expert: missing {_few(missing)}, unexpected {_few(unknown)}",
            missing=missing[:20], unexpected=unknown[:20])
    for name, shape in manifest:
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise InvalidUpdate(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        if t.dtype != torch.float32:
            raise InvalidUpdate(f"tensor {name!r} has dtype {str(t.dtype).replace('torch.', '')}, expected float32")
        if not bool(torch.isfinite(t).all()):
            raise InvalidUpdate(f"tensor {name!r} contains NaN or Inf")


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


