"""Natural compression (Horvath et al., 2019): stochastic rounding to powers of two.

``|x|`` in ``[2^e, 2^(e+1))`` becomes ``2^(e+1)`` with probability
``(|x| - 2^e) / 2^e`` and ``2^e`` otherwise, which is unbiased. Exponents are
sent relative to the largest one: payload is an int16 ``e_max`` then one code
per value of ``bits`` bits: 0 means zero, otherwise the top bit is the sign
and the rest is ``1 + e_max - e``. Magnitudes below the smallest representable
power ``2^e_min`` round stochastically between 0 and ``2^e_min`` (still unbiased).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from compression.base import Codec, Shape, make_rng
from compression.buffers import Reader, pack_codes, packed_size, unpack_codes
from compression.config import require_int
from compression.errors import CompressionError, PayloadError

MIN_EXPONENT = -149  # 2**-149 is the smallest float32 subnormal
MAX_EXPONENT = 127


@dataclasses.dataclass(frozen=True)
class NaturalConfig:
    """Options of the natural codec."""

    bits: int = 8
    """Bits per value (2..8): one sign bit, the rest index 2**(bits-1) - 1 powers of two."""
    seed: int = 0
    """Seed of the stochastic rounding."""

    def __post_init__(self) -> None:
        require_int("bits", self.bits, 2, 8)
        require_int("seed", self.seed, 0)


class Natural(Codec):
    """Unbiased rounding to signed powers of two, relative to the largest exponent."""

    name = "natural"
    config_class = NaturalConfig
    config: NaturalConfig

    @property
    def powers(self) -> int:
        return (1 << (self.config.bits - 1)) - 1

    def _encode(self, flat: np.ndarray, seed: int, shape: Shape) -> bytes:
        magnitude = np.abs(flat).astype(np.float64)
        mantissa, exponent = np.frexp(magnitude)  # magnitude = mantissa * 2**exponent, mantissa in [0.5, 1)
        e_max = int(exponent[magnitude > 0].max()) if magnitude.any() else 0
        if e_max > MAX_EXPONENT:
            raise CompressionError("a value is too close to the float32 maximum for natural compression")
        e_min = e_max - self.powers + 1
        noise = make_rng(self.config.seed, seed).random(flat.size)
        chosen = (exponent - 1) + (noise < 2 * mantissa - 1)  # round up with prob (|x| - 2^(e-1)) / 2^(e-1)
        tiny = exponent - 1 < e_min
        chosen = np.where(tiny, e_min, chosen)
        keep = np.where(tiny, noise < magnitude / np.ldexp(1.0, e_min), magnitude > 0)
        codes = np.where(keep, 1 + e_max - chosen, 0) | ((flat < 0) & keep) << (self.config.bits - 1)
        return int(e_max).to_bytes(2, "little", signed=True) + pack_codes(codes.astype(np.uint8), self.config.bits)

    def _decode(self, reader: Reader, numel: int, shape: Shape) -> np.ndarray:
        (e_max,) = reader.unpack("h", "natural exponent")
        if not MIN_EXPONENT <= e_max <= MAX_EXPONENT:
            raise PayloadError(f"natural exponent {e_max} is outside the float32 range")
        bits = self.config.bits
        codes = unpack_codes(reader.take(packed_size(numel, bits), "natural codes"), numel, bits, "natural codes")
        sign, offset = codes >> (bits - 1), (codes & self.powers).astype(np.int32)
        if np.any((offset == 0) & (sign == 1)):
            raise PayloadError("natural code has a sign but no magnitude")
        magnitude = np.where(offset > 0, np.ldexp(np.float32(1), e_max + 1 - offset), np.float32(0))
        return np.where(sign == 1, -magnitude, magnitude).astype(np.float32)
