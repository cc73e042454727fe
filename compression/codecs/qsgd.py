"""QSGD (Alistarh et al., 2017): unbiased stochastic quantization to s levels.

Each bucket keeps its L2 norm; value ``x`` becomes ``norm * sign(x) * l / s``
where the level ``l`` is ``floor(s|x|/norm)`` or one more, chosen so that the
expectation is ``x``. Payload: fp32 bucket norms, then signed levels
``l * sign + s`` packed in ``bit_length(2s)`` bits each.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from compression.base import Codec, Shape, make_rng, pad_to_blocks
from compression.buffers import Reader, pack_codes, packed_size, unpack_codes
from compression.config import require_int
from compression.errors import PayloadError


@dataclasses.dataclass(frozen=True)
class QSGDConfig:
    """Options of the qsgd codec."""

    levels: int = 16
    """Number of magnitude levels s per sign (1..127); codes take bit_length(2s) bits."""
    bucket_size: int = 512
    """Values sharing one L2 norm; smaller buckets mean lower variance and more norm bytes."""
    seed: int = 0
    """Seed of the stochastic rounding."""

    def __post_init__(self) -> None:
        require_int("levels", self.levels, 1, 127)
        require_int("bucket_size", self.bucket_size, 1, 1 << 24)
        require_int("seed", self.seed, 0)


def round_up_f32(values: np.ndarray) -> np.ndarray:
    """float64 values rounded up to the next float32, so dividing by them stays <= 1."""
    down = values.astype(np.float32)
    return np.where(down.astype(np.float64) < values, np.nextafter(down, np.float32(np.inf)), down)


class QSGD(Codec):
    """Stochastic s-level quantization against per-bucket L2 norms."""

    name = "qsgd"
    config_class = QSGDConfig
    config: QSGDConfig

    @property
    def bits(self) -> int:
        return (2 * self.config.levels).bit_length()

    def _encode(self, flat: np.ndarray, seed: int, shape: Shape) -> bytes:
        s = self.config.levels
        buckets = pad_to_blocks(flat, self.config.bucket_size)
        norms = round_up_f32(np.sqrt(np.einsum("ij,ij->i", buckets, buckets, dtype=np.float64)))
        per_level = (norms / np.float32(s))[:, None]
        scaled = np.divide(np.abs(buckets), per_level, out=np.zeros_like(buckets), where=per_level > 0)
        lower = np.floor(scaled)
        noise = make_rng(self.config.seed, seed).random(scaled.shape, dtype=np.float32)
        levels = np.minimum(lower + (noise < scaled - lower), s)
        codes = (np.where(buckets < 0, -levels, levels) + s).astype(np.uint8).reshape(-1)
        return norms.astype("<f4").tobytes() + pack_codes(codes[: flat.size], self.bits)

    def _decode(self, reader: Reader, numel: int, shape: Shape) -> np.ndarray:
        s, bucket = self.config.levels, self.config.bucket_size
        norms = reader.array("<f4", -(-numel // bucket), "qsgd norms")
        if not (np.isfinite(norms) & (norms >= 0)).all():
            raise PayloadError("qsgd norms must be finite and non-negative")
        codes = unpack_codes(reader.take(packed_size(numel, self.bits), "qsgd codes"), numel, self.bits, "qsgd codes")
        if np.any(codes > 2 * s):
            raise PayloadError(f"a qsgd code exceeds {2 * s}")
        signed_levels = codes.astype(np.float32) - np.float32(s)
        return signed_levels * (np.repeat(norms, bucket)[:numel] / np.float32(s))
