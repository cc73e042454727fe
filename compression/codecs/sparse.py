"""Shared machinery of sparsifiers: a support (which entries) plus their values.

A sparsifier payload is its support section followed by the kept values as
written by a values codec: fp32 by default, or the quantizer of a pipeline
such as ``topk+int8``.
"""
from __future__ import annotations

from abc import abstractmethod

import numpy as np

from compression.base import Codec, PayloadStats, Shape, derive_seed
from compression.buffers import Reader
from compression.codecs.casts import RawFloat32
from compression.errors import PayloadError

FP32_VALUES = RawFloat32()


class Sparsifier(Codec):
    """A codec that transmits a subset of entries; the rest decode as zero."""

    kind = "sparsifier"

    @abstractmethod
    def _select(self, flat: np.ndarray, seed: int) -> tuple[np.ndarray, bytes]:
        """Sorted distinct indices to send, and the support bytes describing them."""

    @abstractmethod
    def _read_support(self, reader: Reader, numel: int) -> np.ndarray:
        """Read the support section and return the sorted indices it names."""

    def _kept_values(self, flat: np.ndarray, indices: np.ndarray) -> np.ndarray:
        return flat[indices]

    def encode_sparse(self, flat: np.ndarray, seed: int, values: Codec) -> bytes:
        """Support bytes, then the kept values encoded by ``values``."""
        indices, support = self._select(flat, seed)
        kept = np.ascontiguousarray(self._kept_values(flat, indices), dtype=np.float32)
        return support + values._encode(kept, derive_seed(seed, 1), (kept.size,))

    def decode_sparse(self, reader: Reader, numel: int, values: Codec) -> np.ndarray:
        indices = self._read_support(reader, numel)
        kept = values._decode(reader, indices.size, (indices.size,))
        if kept.shape != indices.shape:
            raise PayloadError(f"{self.name}: got {kept.size} values for {indices.size} indices")
        out = np.zeros(numel, dtype=np.float32)
        out[indices] = kept
        return out

    def _encode(self, flat: np.ndarray, seed: int, shape: Shape) -> bytes:
        return self.encode_sparse(flat, seed, FP32_VALUES)

    def _decode(self, reader: Reader, numel: int, shape: Shape) -> np.ndarray:
        return self.decode_sparse(reader, numel, FP32_VALUES)

    def _inspect(self, reader: Reader, numel: int, shape: Shape) -> PayloadStats:
        indices = self._read_support(reader, numel)
        return PayloadStats(index_bytes=self._index_bytes(reader.position), sent=indices.size)

    def _index_bytes(self, support_bytes: int) -> int:
        """Bytes of the support section that describe positions (all of it by default)."""
        return support_bytes


def kept_per_chunk(numel: int, ratio: float, chunk: int) -> np.ndarray:
    """How many entries each chunk keeps: ``ceil(ratio * chunk length)``, at least one."""
    lengths = np.full(numel // chunk, chunk, dtype=np.int64)
    if numel % chunk:
        lengths = np.append(lengths, numel % chunk)
    return np.maximum(np.ceil(ratio * lengths - 1e-9), 1).astype(np.int64)
