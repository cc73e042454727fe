"""An update as the flat vector secure aggregation masks, and back.

Both sides know the expert's manifest (sorted tensor names and shapes, ``protocol.tensors``); the
flat vector is the tensors in that order, so coordinate i means the same value to every member
and to the aggregator without any names on the wire.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from privacy.secagg.errors import BadSecAggMessage

Manifest = Sequence[tuple[str, tuple[int, ...]]]


def manifest_numel(manifest: Manifest) -> int:
    return sum(math.prod(shape) for _, shape in manifest)


def flatten(delta: Mapping[str, torch.Tensor], manifest: Manifest) -> np.ndarray:
    """The delta's tensors in manifest order, as one float64 vector (names and shapes must match)."""
    if set(delta) != {name for name, _ in manifest}:
        raise BadSecAggMessage("a delta's tensors must be exactly the expert's manifest")
    parts = []
    for name, shape in manifest:
        tensor = delta[name]
        if tuple(tensor.shape) != tuple(shape):
            raise BadSecAggMessage(f"tensor {name} has shape {tuple(tensor.shape)}, the expert's is {shape}")
        parts.append(tensor.detach().to(torch.float64).reshape(-1).numpy())
    return np.concatenate(parts) if parts else np.zeros(0)


def unflatten(vector: np.ndarray, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The float32 tensors of ``vector``, named and shaped by the manifest."""
    if vector.size != manifest_numel(manifest):
        raise BadSecAggMessage(f"a vector of {vector.size} values for a manifest of {manifest_numel(manifest)}")
    out, start = {}, 0
    for name, shape in manifest:
        size = math.prod(shape)
        out[name] = torch.from_numpy(vector[start:start + size].astype(np.float32).reshape(shape))
        start += size
    return out
