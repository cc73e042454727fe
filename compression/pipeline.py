"""Composition of a sparsifier with a value quantizer, e.g. ``topk+int8``.

The payload is the sparsifier's support section followed by the kept values
as encoded by the quantizer (which sees them as a flat vector of k values).
"""
from __future__ import annotations

import numpy as np

from compression.base import Codec, PayloadStats, Shape
from compression.buffers import Reader
from compression.codecs.sparse import Sparsifier
from compression.errors import CompressionError


class Pipeline(Codec):
    """A sparsifier whose kept values go through a quantizer."""

    name = "pipeline"
    kind = "pipeline"

    def __init__(self, sparsifier: Codec, quantizer: Codec) -> None:
        if not isinstance(sparsifier, Sparsifier):
            raise CompressionError(
                f"a pipeline starts with a sparsifier (topk, randomk, threshold), got {sparsifier.spec!r}"
            )
        if quantizer.kind != "quantizer":
            raise CompressionError(
                f"a pipeline ends with a value quantizer (e.g. int8, fp16), got {quantizer.spec!r}"
            )
        super().__init__()
        self.sparsifier = sparsifier
        self.quantizer = quantizer

    @property
    def spec(self) -> str:
        return f"{self.sparsifier.spec}+{self.quantizer.spec}"

    def __repr__(self) -> str:
        return f"Pipeline({self.sparsifier!r}, {self.quantizer!r})"

    def _encode(self, flat: np.ndarray, seed: int, shape: Shape) -> bytes:
        return self.sparsifier.encode_sparse(flat, seed, self.quantizer)

    def _decode(self, reader: Reader, numel: int, shape: Shape) -> np.ndarray:
        return self.sparsifier.decode_sparse(reader, numel, self.quantizer)

    def _inspect(self, reader: Reader, numel: int, shape: Shape) -> PayloadStats:
        return self.sparsifier._inspect(reader, numel, shape)
