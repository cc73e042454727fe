"""Random-k sparsification with a shared seed: no index bytes on the wire.

``k = ceil(ratio * numel)`` entries chosen uniformly without replacement by a
PCG64 stream keyed on a 64-bit selection seed. Payload: that seed (u64),
then the values. The decoder regenerates the same selection from the seed.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from compression.base import derive_seed, make_rng
from compression.buffers import Reader
from compression.codecs.sparse import Sparsifier
from compression.config import require_int, require_real
from compression.errors import CompressionError


@dataclasses.dataclass(frozen=True)
class RandomKConfig:
    """Options of the randomk codec."""

    ratio: float = 0.01
    """Fraction of entries sent, in (0, 1]."""
    rescale: bool = False
    """Multiply sent values by numel/k so the estimate is unbiased (leave off with error feedback)."""
    seed: int = 0
    """Mixed with the per-call seed into the selection seed."""

    def __post_init__(self) -> None:
        require_real("ratio", self.ratio, 0.0, 1.0, low_open=True)
        if not isinstance(self.rescale, bool):
            raise CompressionError(f"rescale must be true or false, got {self.rescale!r}")
        require_int("seed", self.seed, 0)


def random_indices(numel: int, k: int, selection_seed: int) -> np.ndarray:
    """Sorted ``k`` distinct indices below ``numel``: the k smallest of uniform keys."""
    if k >= numel:
        return np.arange(numel, dtype=np.int64)
    keys = make_rng(selection_seed).random(numel)
    return np.sort(np.argpartition(keys, k - 1)[:k]).astype(np.int64)


class RandomK(Sparsifier):
    """Sends a seeded random subset of entries."""

    name = "randomk"
    config_class = RandomKConfig
    config: RandomKConfig

    def kept(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.config.ratio * numel - 1e-9)))

    def _select(self, flat: np.ndarray, seed: int) -> tuple[np.ndarray, bytes]:
        selection_seed = derive_seed(self.config.seed, seed)
        indices = random_indices(flat.size, self.kept(flat.size), selection_seed)
        return indices, selection_seed.to_bytes(8, "little")

    def _kept_values(self, flat: np.ndarray, indices: np.ndarray) -> np.ndarray:
        values = flat[indices]
        if self.config.rescale and indices.size:
            values = values * np.float32(flat.size / indices.size)
        return values

    def _read_support(self, reader: Reader, numel: int) -> np.ndarray:
        (selection_seed,) = reader.unpack("Q", "randomk seed")
        return random_indices(numel, self.kept(numel), selection_seed)

    def _index_bytes(self, support_bytes: int) -> int:
        return 0  # the 8-byte seed replaces indices; it is counted in bytes_sent, not here
