"""Top-k sparsification by magnitude, chunk by chunk.

Each chunk of ``chunk_size`` entries keeps its ``ceil(ratio * length)``
largest magnitudes, so the count is implied by ``numel`` and not sent.
Payload: the sorted indices as gaps in Golomb-Rice or varint code, then the
values.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from compression.buffers import Reader
from compression.codecs.sparse import Sparsifier, kept_per_chunk
from compression.config import require_choice, require_int, require_real
from compression.errors import PayloadError
from compression.index_coding import INDEX_CODINGS


@dataclasses.dataclass(frozen=True)
class TopKConfig:
    """Options of the topk codec."""

    ratio: float = 0.01
    """Fraction of entries kept in every chunk, in (0, 1]."""
    chunk_size: int = 4096
    """Entries ranked together; each chunk keeps ceil(ratio * its length)."""
    index_coding: str = "rice"
    """Index code: 'rice' (Golomb-Rice of gaps) or 'varint' (LEB128 of gaps)."""

    def __post_init__(self) -> None:
        require_real("ratio", self.ratio, 0.0, 1.0, low_open=True)
        require_int("chunk_size", self.chunk_size, 1, 1 << 30)
        require_choice("index_coding", self.index_coding, INDEX_CODINGS)


def topk_indices(flat: np.ndarray, ratio: float, chunk: int) -> np.ndarray:
    """Sorted indices of the largest magnitudes of every chunk."""
    counts = kept_per_chunk(flat.size, ratio, chunk)
    full = flat.size // chunk
    picks = []
    if full:
        k = int(counts[0])
        ranked = np.argpartition(np.abs(flat[: full * chunk]).reshape(full, chunk), chunk - k, axis=1)
        picks.append((ranked[:, chunk - k :] + np.arange(full)[:, None] * chunk).ravel())
    if flat.size % chunk:
        tail, k = np.abs(flat[full * chunk :]), int(counts[-1])
        picks.append(np.argpartition(tail, tail.size - k)[tail.size - k :] + full * chunk)
    return np.sort(np.concatenate(picks)) if picks else np.zeros(0, dtype=np.int64)


class TopK(Sparsifier):
    """Keeps the largest-magnitude entries of each chunk."""

    name = "topk"
    config_class = TopKConfig
    config: TopKConfig

    def _select(self, flat: np.ndarray, seed: int) -> tuple[np.ndarray, bytes]:
        cfg = self.config
        indices = topk_indices(flat, cfg.ratio, cfg.chunk_size)
        return indices, INDEX_CODINGS[cfg.index_coding].encode(indices, flat.size)

    def _read_support(self, reader: Reader, numel: int) -> np.ndarray:
        cfg = self.config
        counts = kept_per_chunk(numel, cfg.ratio, cfg.chunk_size)
        indices = INDEX_CODINGS[cfg.index_coding].decode(reader, int(counts.sum()), numel)
        per_chunk = np.bincount(indices // cfg.chunk_size, minlength=counts.size)
        if not np.array_equal(per_chunk, counts):
            raise PayloadError("topk indices do not match the per-chunk counts implied by ratio")
        return indices
