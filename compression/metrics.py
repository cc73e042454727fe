"""Honest byte accounting and distortion of one compressed update."""
from __future__ import annotations

import math
from typing import Any

import torch

from compression.base import Codec
from compression.errors import CompressionError
from compression.wire import Manifest, inspect_update


def measure(
    original: dict[str, torch.Tensor],
    decoded: dict[str, torch.Tensor],
    payload: bytes,
    encode_ms: float,
    decode_ms: float,
    *,
    codec: Codec | None = None,
    manifest: Manifest | None = None,
) -> dict[str, Any]:
    """Bytes, ratio and error of an update; pass ``codec`` and ``manifest`` for index accounting.

    Without them ``index_bytes`` and ``framing_bytes`` are None and ``density``
    falls back to the fraction of non-zero decoded entries.
    """
    x, y = _flatten(original, decoded)
    numel = x.numel()
    bytes_raw, bytes_sent = 4 * numel, len(payload)
    metrics: dict[str, Any] = {
        "numel": numel,
        "bytes_raw": bytes_raw,
        "bytes_sent": bytes_sent,
        "ratio": bytes_raw / bytes_sent if bytes_sent else math.inf,
        "bits_per_param": 8 * bytes_sent / numel if numel else 0.0,
        "relative_error": relative_error(x, y),
        "cosine": cosine(x, y),
        "encode_ms": float(encode_ms),
        "decode_ms": float(decode_ms),
    }
    metrics.update(_payload_accounting(payload, y, codec, manifest))
    return metrics


def _payload_accounting(
    payload: bytes, y: torch.Tensor, codec: Codec | None, manifest: Manifest | None
) -> dict[str, Any]:
    if codec is None or manifest is None:
        density = float(torch.count_nonzero(y)) / y.numel() if y.numel() else 1.0
        return {"density": density, "index_bytes": None, "framing_bytes": None}
    stats = inspect_update(payload, manifest, codec)
    return {
        "density": stats.sent / stats.numel if stats.numel else 1.0,
        "index_bytes": stats.index_bytes,
        "framing_bytes": stats.framing_bytes,
    }


def _flatten(original: dict[str, torch.Tensor], decoded: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if set(original) != set(decoded):
        raise CompressionError("original and decoded updates name different tensors")
    names = sorted(original)
    x = torch.cat([original[n].detach().reshape(-1).double() for n in names]) if names else torch.zeros(0)
    y = torch.cat([decoded[n].detach().reshape(-1).double() for n in names]) if names else torch.zeros(0)
    if x.shape != y.shape:
        raise CompressionError(f"original has {x.numel()} values, decoded has {y.numel()}")
    return x, y


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """``||x - y|| / ||x||``; 0 when both are zero, inf when only ``x`` is."""
    norm = float(torch.linalg.vector_norm(x))
    diff = float(torch.linalg.vector_norm(x - y))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def cosine(x: torch.Tensor, y: torch.Tensor) -> float:
    """Cosine similarity; 1 when both are zero, 0 when only one is."""
    nx, ny = float(torch.linalg.vector_norm(x)), float(torch.linalg.vector_norm(y))
    if nx == 0.0 or ny == 0.0:
        return 1.0 if nx == ny else 0.0
    return float(torch.dot(x, y)) / (nx * ny)
