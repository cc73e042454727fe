"""Plain float casts: fp32 (``none``), fp16 and bf16, little-endian."""
from __future__ import annotations

import numpy as np

from compression.base import Codec, Shape
from compression.buffers import Reader
from compression.errors import CompressionError


class RawFloat32(Codec):
    """Lossless baseline: the values as little-endian fp32."""

    name = "none"

    def _encode(self, flat: np.ndarray, seed: int, shape: Shape) -> bytes:
        return flat.astype("<f4", copy=False).tobytes()

    def _decode(self, reader: Reader, numel: int, shape: Shape) -> np.ndarray:
        return reader.array("<f4", numel, "fp32 values").astype(np.float32)


class Float16(Codec):
    """IEEE half precision, round to nearest even; refuses values beyond +-65504."""

    name = "fp16"

    def _encode(self, flat: np.ndarray, seed: int, shape: Shape) -> bytes:
        with np.errstate(over="ignore"):
            half = flat.astype("<f2")
        if np.isinf(half).any():
            raise CompressionError("a value exceeds the fp16 range (+-65504); use bf16 or int8")
        return half.tobytes()

    def _decode(self, reader: Reader, numel: int, shape: Shape) -> np.ndarray:
        return reader.array("<f2", numel, "fp16 values").astype(np.float32)


class BFloat16(Codec):
    """Top 16 bits of fp32 with round to nearest even: fp32 range, 8-bit mantissa."""

    name = "bf16"

    def _encode(self, flat: np.ndarray, seed: int, shape: Shape) -> bytes:
        bits = flat.astype(np.float32).view(np.uint32)
        rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
        upper = (rounded >> np.uint32(16)).astype("<u2")
        if np.any((upper & 0x7F80) == 0x7F80):
            raise CompressionError("a value rounds to infinity in bf16; it is too close to the fp32 maximum")
        return upper.tobytes()

    def _decode(self, reader: Reader, numel: int, shape: Shape) -> np.ndarray:
        upper = reader.array("<u2", numel, "bf16 values").astype(np.uint32)
        return (upper << np.uint32(16)).view(np.float32)
