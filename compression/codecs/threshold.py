"""Threshold-v sparsification: send every entry with ``|x| >= threshold``.

The count varies, so it is sent. Payload: u32 count, the sorted indices as
gaps in Golomb-Rice or varint code, then the values.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from compression.buffers import Reader
from compression.codecs.sparse import Sparsifier
from compression.config import require_choice, require_real
from compression.errors import PayloadError
from compression.index_coding import INDEX_CODINGS


@dataclasses.dataclass(frozen=True)
class ThresholdConfig:
    """Options of the threshold codec."""

    threshold: float = 1e-3
    """Entries with magnitude at or above this value are sent; must be > 0."""
    index_coding: str = "rice"
    """Index code: 'rice' (Golomb-Rice of gaps) or 'varint' (LEB128 of gaps)."""

    def __post_init__(self) -> None:
        require_real("threshold", self.threshold, 0.0, float(np.finfo(np.float32).max), low_open=True)
        require_choice("index_coding", self.index_coding, INDEX_CODINGS)


class Threshold(Sparsifier):
    """Keeps entries whose magnitude reaches a fixed threshold."""

    name = "threshold"
    config_class = ThresholdConfig
    config: ThresholdConfig

    def _select(self, flat: np.ndarray, seed: int) -> tuple[np.ndarray, bytes]:
        indices = np.flatnonzero(np.abs(flat) >= np.float32(self.config.threshold))
        coded = INDEX_CODINGS[self.config.index_coding].encode(indices, flat.size)
        return indices, indices.size.to_bytes(4, "little") + coded

    def _read_support(self, reader: Reader, numel: int) -> np.ndarray:
        (count,) = reader.unpack("I", "threshold count")
        if count > numel:
            raise PayloadError(f"threshold count {count} exceeds {numel} values")
        return INDEX_CODINGS[self.config.index_coding].decode(reader, count, numel)
