"""Error feedback: carry what compression dropped into the next sync.

Each call compresses ``delta + residual`` and keeps
``residual = decay * (delta + residual - decoded)``, so with ``decay = 1`` the
sum of everything the receiver decoded plus the final residual equals the sum
of the deltas that were meant to be sent.

The residual lives in the space of the tensors (weight space for a worker's delta), not of any
codec's payload, so ``compress`` may be given a different codec each call (the worker's
``--compression auto`` does): what one codec dropped is offered to the next.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from compression.base import Codec
from compression.config import require_real
from compression.errors import CompressionError
from compression.wire import Manifest, check_manifest, check_tensor_names, decode_update, encode_update


@dataclass(frozen=True)
class Compressed:
    """One compressed update: its payload and exactly what the receiver will decode from it."""

    payload: bytes
    decoded: dict[str, torch.Tensor]
    encode_ms: float
    """Encoding time (without the decode and the residual update)."""
    decode_ms: float
    """Decoding time: what the receiver will spend on the payload."""


class ErrorFeedback:
    """Per-tensor residual memory around a codec."""

    def __init__(self, codec: Codec | None, decay: float = 1.0) -> None:
        """``codec``: the default of ``compress`` (None: every call names its codec)."""
        require_real("decay", decay, 0.0, 1.0)
        self.codec = codec
        self.decay = float(decay)
        self._residual: dict[str, torch.Tensor] = {}

    def compress(
        self, tensors: dict[str, torch.Tensor], manifest: Manifest, seed: int = 0, codec: Codec | None = None
    ) -> Compressed:
        """Encode ``tensors + residual`` with ``codec`` (default: this object's); the payload and its decoding."""
        codec = codec or self.codec
        if codec is None:
            raise CompressionError("ErrorFeedback.compress needs a codec: none given and no default")
        entries = check_manifest(manifest)
        check_tensor_names(tensors, entries)
        target = {name: self._corrected(name, shape, tensors) for name, shape in entries}
        started = time.perf_counter()
        payload = encode_update(target, entries, codec, seed)
        encoded = time.perf_counter()
        sent = decode_update(payload, entries, codec)
        decoded = time.perf_counter()
        self._residual = {name: (target[name] - sent[name]) * self.decay for name, _ in entries}
        return Compressed(payload, sent, (encoded - started) * 1000, (decoded - encoded) * 1000)

    def _corrected(self, name: str, shape: tuple[int, ...], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        delta = tensors[name].detach().to(torch.float32)
        residual = self._residual.get(name)
        if residual is None:
            return delta
        if residual.shape != delta.shape:
            raise CompressionError(f"residual for {name!r} has shape {tuple(residual.shape)}, delta has {tuple(delta.shape)}")
        return delta + residual

    @property
    def residual(self) -> dict[str, torch.Tensor]:
        """The live residuals, not copied: read only (``compress`` replaces them, never mutates them)."""
        return self._residual

    def reset(self) -> None:
        """Forget all residuals (e.g. after the base model changed)."""
        self._residual = {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Residuals as contiguous fp32 tensors, ready for ``safetensors.torch.save_file``."""
        return {name: r.detach().clone().contiguous() for name, r in self._residual.items()}

    @staticmethod
    def check_residual(state: dict[str, torch.Tensor]) -> None:
        """Raise CompressionError unless every residual is a finite floating point tensor."""
        for name, tensor in state.items():
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise CompressionError(f"residual {name!r} must be a floating point tensor")
            if not torch.isfinite(tensor).all():
                raise CompressionError(f"residual {name!r} has NaN or infinite values")

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore residuals saved by ``state_dict``."""
        self.check_residual(state)
        self._residual = {name: t.detach().to(torch.float32).clone() for name, t in state.items()}
