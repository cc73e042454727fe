"""Error feedback: carry what compression dropped into the next sync.

Each call compresses ``delta + residual`` and keeps
``residual = decay * (delta + residual - decoded)``, so with ``decay = 1`` the
sum of everything the receiver decoded plus the final residual equals the sum
of the deltas that were meant to be sent.
"""
from __future__ import annotations

import torch

from compression.base import Codec
from compression.config import require_real
from compression.errors import CompressionError
from compression.wire import Manifest, check_manifest, check_tensor_names, decode_update, encode_update


class ErrorFeedback:
    """Per-tensor residual memory around a codec."""

    def __init__(self, codec: Codec, decay: float = 1.0) -> None:
        require_real("decay", decay, 0.0, 1.0)
        self.codec = codec
        self.decay = float(decay)
        self._residual: dict[str, torch.Tensor] = {}

    def compress(
        self, tensors: dict[str, torch.Tensor], manifest: Manifest, seed: int = 0
    ) -> tuple[bytes, dict[str, torch.Tensor]]:
        """Encode ``tensors + residual``; return the payload and what the receiver will decode."""
        entries = check_manifest(manifest)
        check_tensor_names(tensors, entries)
        target = {name: self._corrected(name, shape, tensors) for name, shape in entries}
        payload = encode_update(target, entries, self.codec, seed)
        sent = decode_update(payload, entries, self.codec)
        self._residual = {name: (target[name] - sent[name]) * self.decay for name, _ in entries}
        return payload, sent

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
