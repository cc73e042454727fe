"""Scaled signSGD: one bit per value, times the mean magnitude.

Payload: fp32 scale ``mean|x|``, then the sign bits packed with
``np.packbits`` (little bit order; 1 means non-negative).
"""
from __future__ import annotations

import numpy as np

from compression.base import Codec, Shape
from compression.buffers import Reader, packed_size, unpack_codes
from compression.errors import PayloadError


class SignSGD(Codec):
    """Deterministic 1-bit sign compression with an L1-preserving scale."""

    name = "signsgd"

    def _encode(self, flat: np.ndarray, seed: int, shape: Shape) -> bytes:
        scale = np.float32(np.abs(flat).mean(dtype=np.float64)) if flat.size else np.float32(0)
        signs = np.packbits(flat >= 0, bitorder="little")
        return np.array([scale], dtype="<f4").tobytes() + signs.tobytes()

    def _decode(self, reader: Reader, numel: int, shape: Shape) -> np.ndarray:
        (scale,) = reader.unpack("f", "signsgd scale")
        if not (np.isfinite(scale) and scale >= 0):
            raise PayloadError(f"signsgd scale must be finite and non-negative, got {scale}")
        bits = unpack_codes(reader.take(packed_size(numel, 1), "signsgd signs"), numel, 1, "signsgd signs")
        return np.where(bits == 1, np.float32(scale), np.float32(-scale))
