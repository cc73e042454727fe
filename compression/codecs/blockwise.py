"""Blockwise absmax integer quantization (int8 and int4).

Each block of ``block_size`` values shares one scale ``absmax / qmax``;
values are rounded to the nearest integer step, so the error is at most half
a step. Payload: all block scales, then all integer codes.
"""
from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import ClassVar

import numpy as np

from compression.base import Codec, Shape, make_rng, pad_to_blocks
from compression.buffers import Reader, pack_codes, packed_size, unpack_codes
from compression.config import require_choice, require_int
from compression.errors import CompressionError, PayloadError

@dataclasses.dataclass(frozen=True)
class BlockwiseConfig:
    """Options of the int8 and int4 codecs."""

    block_size: int = 64
    """Number of consecutive values that share one scale."""
    scale_dtype: str = "fp32"
    """Storage of the per-block scale: 'fp32' (4 bytes) or 'fp16' (2 bytes, rounded up)."""
    stochastic: bool = False
    """Round stochastically (unbiased, error below one step) instead of to nearest."""
    seed: int = 0
    """Seed of the stochastic rounding; unused when rounding to nearest."""

    def __post_init__(self) -> None:
        require_int("block_size", self.block_size, 1, 1 << 24)
        require_choice("scale_dtype", self.scale_dtype, SCALE_FORMATS)
        if not isinstance(self.stochastic, bool):
            raise CompressionError(f"stochastic must be true or false, got {self.stochastic!r}")
        require_int("seed", self.seed, 0)


def _fp32_scales(scales: np.ndarray) -> np.ndarray:
    return scales


def _fp16_scales(scales: np.ndarray) -> np.ndarray:
    """Round up to fp16 so that no value divided by its stored scale exceeds qmax."""
    with np.errstate(over="ignore"):
        half = scales.astype(np.float16)
    half = np.where(half.astype(np.float32) < scales, np.nextafter(half, np.float16(np.inf)), half)
    if np.isinf(half).any():
        raise CompressionError("a block absmax overflows an fp16 scale; use scale_dtype='fp32'")
    return half


# scale_dtype -> (wire dtype, how float32 scales become stored scales)
SCALE_FORMATS = {"fp32": ("<f4", _fp32_scales), "fp16": ("<f2", _fp16_scales)}


class Blockwise(Codec):
    """Shared machinery of the blockwise integer codecs."""

    config_class = BlockwiseConfig
    config: BlockwiseConfig
    qmax: ClassVar[int]
    """Largest code magnitude: 127 for int8, 7 for int4."""

    def _encode(self, flat: np.ndarray, seed: int, shape: Shape) -> bytes:
        cfg = self.config
        blocks = pad_to_blocks(flat, cfg.block_size)
        wire_dtype, store = SCALE_FORMATS[cfg.scale_dtype]
        absmax = np.abs(blocks).max(axis=1, initial=0.0)
        scales = store((absmax / np.float32(self.qmax)).astype(np.float32))
        steps = scales.astype(np.float32)[:, None]
        ratio = np.divide(blocks, steps, out=np.zeros_like(blocks), where=steps > 0)
        codes = self._round(ratio, seed).reshape(-1)[: flat.size]
        return scales.astype(wire_dtype).tobytes() + self._pack(codes)

    def _round(self, ratio: np.ndarray, seed: int) -> np.ndarray:
        if self.config.stochastic:
            noise = make_rng(self.config.seed, seed).random(ratio.shape, dtype=np.float32)
            rounded = np.floor(ratio + noise)
        else:
            rounded = np.rint(ratio)
        return np.clip(rounded, -self.qmax, self.qmax).astype(np.int8)

    def _decode(self, reader: Reader, numel: int, shape: Shape) -> np.ndarray:
        block = self.config.block_size
        nblocks = -(-numel // block)
        scales = reader.array(SCALE_FORMATS[self.config.scale_dtype][0], nblocks, "block scales")
        if not (np.isfinite(scales) & (scales >= 0)).all():
            raise PayloadError("block scales must be finite and non-negative")
        codes = self._unpack(reader, numel)
        if numel and (int(codes.min()) < -self.qmax or int(codes.max()) > self.qmax):
            raise PayloadError(f"a code lies outside [-{self.qmax}, {self.qmax}]")
        # Per block (no repeated scale vector): two passes over the values fewer than before.
        padded = np.zeros(nblocks * block, dtype=np.float32)
        padded[:numel] = codes
        padded.reshape(nblocks, block)[...] *= scales.astype(np.float32)[:, None]
        return padded[:numel]

    @abstractmethod
    def _pack(self, codes: np.ndarray) -> bytes:
        """Serialise int8 codes already clipped to [-qmax, qmax]."""

    @abstractmethod
    def _unpack(self, reader: Reader, numel: int) -> np.ndarray:
        """Read ``numel`` codes as int8."""


class Int8(Blockwise):
    """Blockwise absmax int8: codes in [-127, 127], one byte each."""

    name = "int8"
    qmax = 127

    def _pack(self, codes: np.ndarray) -> bytes:
        return codes.astype(np.int8).tobytes()

    def _unpack(self, reader: Reader, numel: int) -> np.ndarray:
        return reader.array("i1", numel, "int8 codes")


class Int4(Blockwise):
    """Blockwise absmax int4: codes in [-7, 7], two's complement, two per byte (low nibble first)."""

    name = "int4"
    qmax = 7

    def _pack(self, codes: np.ndarray) -> bytes:
        return pack_codes(codes.view(np.uint8) & 0x0F, 4)

    def _unpack(self, reader: Reader, numel: int) -> np.ndarray:
        nibbles = unpack_codes(reader.take(packed_size(numel, 4), "int4 codes"), numel, 4, "int4 codes")
        return np.where(nibbles >= 8, nibbles.astype(np.int16) - 16, nibbles).astype(np.int8)
