"""TernGrad (Wen et al., 2017): unbiased ternary quantization.

With ``scale = max|x|``, value ``x`` becomes ``scale * sign(x)`` with
probability ``|x| / scale`` and 0 otherwise. Payload: fp32 scale, then one
2-bit code per value (0: zero, 1: +scale, 2: -scale; 3 is invalid).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from compression.base import Codec, Shape, make_rng
from compression.buffers import Reader, pack_codes, packed_size, unpack_codes
from compression.config import require_int
from compression.errors import PayloadError


@dataclasses.dataclass(frozen=True)
class TernGradConfig:
    """Options of the terngrad codec."""

    seed: int = 0
    """Seed of the stochastic rounding."""

    def __post_init__(self) -> None:
        require_int("seed", self.seed, 0)


class TernGrad(Codec):
    """Stochastic {-1, 0, +1} times the tensor's max magnitude."""

    name = "terngrad"
    config_class = TernGradConfig
    config: TernGradConfig

    def _encode(self, flat: np.ndarray, seed: int, shape: Shape) -> bytes:
        scale = np.float32(np.abs(flat).max(initial=0.0))
        keep_prob = flat.astype(np.float64) / scale if scale > 0 else np.zeros(flat.size)
        fire = make_rng(self.config.seed, seed).random(flat.size) < np.abs(keep_prob)
        codes = np.where(fire, np.where(flat < 0, 2, 1), 0).astype(np.uint8)
        return np.array([scale], dtype="<f4").tobytes() + pack_codes(codes, 2)

    def _decode(self, reader: Reader, numel: int, shape: Shape) -> np.ndarray:
        (scale,) = reader.unpack("f", "terngrad scale")
        if not (np.isfinite(scale) and scale >= 0):
            raise PayloadError(f"terngrad scale must be finite and non-negative, got {scale}")
        codes = unpack_codes(reader.take(packed_size(numel, 2), "terngrad codes"), numel, 2, "terngrad codes")
        if np.any(codes == 3):
            raise PayloadError("terngrad code 3 is not a valid ternary value")
        signs = np.array([0.0, 1.0, -1.0, 0.0], dtype=np.float32)[codes]
        return signs * np.float32(scale)
