"""The codec interface: flat float32 vectors in, bytes out, and back.

Codecs are stateless. Encoding is deterministic given the config seed and the
per-call ``seed``; everything the decoder needs travels in the payload or is
implied by ``numel``/``shape``, which both sides know from the manifest.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
import torch

from compression.buffers import Reader
from compression.config import NoConfig
from compression.errors import CompressionError, PayloadError

Shape = tuple[int, ...]
Payload = bytes | bytearray | memoryview
"""What a codec decodes: any bytes-like object (a slice of a framed update is a memoryview)."""


@dataclasses.dataclass(frozen=True)
class PayloadStats:
    """What one codec payload carries, for byte accounting."""

    index_bytes: int
    """Bytes spent on positions of transmitted entries (counts, lengths and index codes)."""
    sent: int
    """Number of entries transmitted; ``numel`` for dense codecs."""


class Codec(ABC):
    """Encodes a flat float32 vector to bytes and decodes it back."""

    name: ClassVar[str]
    kind: ClassVar[str] = "quantizer"
    """``quantizer`` (dense, per value), ``sparsifier``, ``lowrank`` or ``pipeline``."""
    config_class: ClassVar[type] = NoConfig

    def __init__(self, config: Any = None) -> None:
        config = self.config_class() if config is None else config
        if not isinstance(config, self.config_class):
            raise CompressionError(
                f"codec {self.name!r} takes a {self.config_class.__name__}, got {type(config).__name__}"
            )
        self.config = config

    @property
    def spec(self) -> str:
        """The registry spec that rebuilds this codec (e.g. ``topk+int8``)."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def encode(self, x: torch.Tensor, seed: int = 0, shape: Shape | None = None) -> bytes:
        """Encode ``x`` (any shape, read flat). ``shape`` matters only to low-rank codecs."""
        flat = tensor_to_flat(x)
        return self._encode(flat, check_seed(seed), check_shape(shape, flat.size))

    def decode(self, payload: Payload, numel: int, shape: Shape | None = None) -> torch.Tensor:
        """Decode a payload into a flat float32 tensor of ``numel`` values."""
        numel = check_numel(numel)
        reader = Reader(check_bytes(payload))
        with np.errstate(over="ignore", invalid="ignore"):  # hostile values end up as inf/nan, rejected below
            values = self._decode(reader, numel, check_shape(shape, numel))
        reader.finish(self.spec)
        return torch.from_numpy(finite_output(values, numel, self.spec))

    def inspect(self, payload: Payload, numel: int, shape: Shape | None = None) -> PayloadStats:
        """Byte accounting for a payload this codec produced."""
        numel = check_numel(numel)
        return self._inspect(Reader(check_bytes(payload)), numel, check_shape(shape, numel))

    # Package-internal hooks, numpy in and out; pipelines call them on their stages.

    @abstractmethod
    def _encode(self, flat: np.ndarray, seed: int, shape: Shape) -> bytes:
        """Encode a read-only flat float32 array of finite values."""

    @abstractmethod
    def _decode(self, reader: Reader, numel: int, shape: Shape) -> np.ndarray:
        """Read exactly this codec's bytes from ``reader`` and return ``numel`` values."""

    def _inspect(self, reader: Reader, numel: int, shape: Shape) -> PayloadStats:
        return PayloadStats(index_bytes=0, sent=numel)


def make_rng(*seeds: int) -> np.random.Generator:
    """A PCG64 generator keyed by a tuple of non-negative integers."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(seeds))))


def derive_seed(*seeds: int) -> int:
    """A 64-bit seed derived from a tuple of seeds (e.g. call seed and tensor index)."""
    state = np.random.SeedSequence(list(seeds)).generate_state(2, dtype=np.uint32)
    return int(state[0]) | (int(state[1]) << 32)


def tensor_to_flat(x: torch.Tensor) -> np.ndarray:
    """Flat float32 numpy view of a finite floating tensor."""
    if not isinstance(x, torch.Tensor):
        raise CompressionError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise CompressionError(f"expected a floating point tensor, got dtype {x.dtype}")
    flat = x.detach().to(device="cpu", dtype=torch.float32).reshape(-1).numpy()
    if not np.isfinite(flat).all():
        raise CompressionError("input tensor has NaN or infinite values; refusing to encode")
    return flat


def pad_to_blocks(flat: np.ndarray, block: int) -> np.ndarray:
    """``flat`` zero-padded to whole blocks and shaped (blocks, block)."""
    padded = np.zeros(-(-flat.size // block) * block, dtype=np.float32)
    padded[: flat.size] = flat
    return padded.reshape(-1, block)


def check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise CompressionError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def check_numel(numel: Any) -> int:
    if isinstance(numel, bool) or not isinstance(numel, numbers.Integral) or numel < 0:
        raise CompressionError(f"numel must be a non-negative integer, got {numel!r}")
    return int(numel)


def check_shape(shape: Any, numel: int) -> Shape:
    """Validate an optional shape against ``numel``; ``None`` means flat."""
    if shape is None:
        return (numel,)
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError as exc:
        raise CompressionError(f"shape must be a tuple of integers, got {shape!r}") from exc
    if any(d < 0 for d in dims) or math.prod(dims) != numel:
        raise CompressionError(f"shape {dims} does not hold {numel} elements")
    return dims


def check_bytes(payload: Any) -> Payload:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise CompressionError(f"payload must be bytes, got {type(payload).__name__}")
    return payload


def finite_output(values: np.ndarray, numel: int, owner: str) -> np.ndarray:
    """Writable float32 copy-if-needed of decoded values, checked for size and finiteness."""
    values = np.require(values, dtype=np.float32, requirements=["C", "W"])
    if values.shape != (numel,):
        raise PayloadError(f"{owner}: decoded {values.size} values, expected {numel}")
    if not np.isfinite(values).all():
        raise PayloadError(f"{owner}: decoded values contain NaN or infinity")
    return values
