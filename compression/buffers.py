"""Bounds-checked payload reading and fixed-width bit packing.

Decoders read only through ``Reader`` so that every overrun becomes a
``PayloadError`` instead of a ``struct.error`` or a numpy exception.
"""
from __future__ import annotations

import struct

import numpy as np

from compression.errors import PayloadError


class Reader:
    """Sequential little-endian reader over a byte payload."""

    def __init__(self, payload: bytes | bytearray | memoryview) -> None:
        self._buf = memoryview(payload).cast("B")
        self._pos = 0

    @property
    def position(self) -> int:
        return self._pos

    @property
    def remaining(self) -> int:
        return len(self._buf) - self._pos

    def take(self, n: int, what: str) -> memoryview:
        """Next ``n`` bytes; ``n`` comes from trusted arithmetic, never raw payload."""
        if n < 0 or n > self.remaining:
            raise PayloadError(f"{what}: needs {n} bytes but only {self.remaining} remain")
        view = self._buf[self._pos : self._pos + n]
        self._pos += n
        return view

    def unpack(self, fmt: str, what: str) -> tuple:
        """``struct.unpack`` of a little-endian format (``fmt`` without the ``<``)."""
        layout = struct.Struct("<" + fmt)
        return layout.unpack(self.take(layout.size, what))

    def array(self, dtype: str, count: int, what: str) -> np.ndarray:
        """Read-only array of ``count`` little-endian items (e.g. dtype ``"<f4"``)."""
        dt = np.dtype(dtype)
        return np.frombuffer(self.take(count * dt.itemsize, what), dtype=dt)

    def peek(self, n: int) -> memoryview:
        """Up to ``n`` next bytes without consuming them."""
        return self._buf[self._pos : self._pos + max(n, 0)]

    def finish(self, what: str) -> None:
        if self.remaining:
            raise PayloadError(f"{what}: {self.remaining} unexpected trailing bytes")


def packed_size(count: int, bits: int) -> int:
    """Bytes needed for ``count`` fields of ``bits`` bits each."""
    return (count * bits + 7) // 8


def _word_dtype(bits: int) -> np.dtype:
    if not 1 <= bits <= 64:
        raise ValueError(f"field width must be 1..64 bits, got {bits}")
    return np.dtype(next(f"<u{n}" for n in (1, 2, 4, 8) if bits <= 8 * n))


def pack_codes(codes: np.ndarray, bits: int) -> bytes:
    """Pack unsigned codes below ``2**bits`` into ``bits``-wide fields, first code lowest."""
    word = _word_dtype(bits)
    codes = np.ascontiguousarray(codes, dtype=word)
    if bits == 8 * word.itemsize:
        return codes.tobytes()
    if 8 % bits == 0:
        return _pack_sub_byte(codes, bits)
    as_bytes = codes.view(np.uint8).reshape(-1, word.itemsize)
    fields = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :bits]
    return np.packbits(fields.ravel(), bitorder="little").tobytes()


def unpack_codes(buf: memoryview | bytes, count: int, bits: int, what: str) -> np.ndarray:
    """Inverse of ``pack_codes``; a wrong size or non-zero padding is a ``PayloadError``."""
    word = _word_dtype(bits)
    raw = np.frombuffer(buf, dtype=np.uint8)
    if raw.size != packed_size(count, bits):
        raise PayloadError(f"{what}: expected {packed_size(count, bits)} bytes, got {raw.size}")
    if bits == 8 * word.itemsize:
        return raw.view(word).copy()
    if 8 % bits == 0:
        return _unpack_sub_byte(raw, count, bits, what)
    flat = np.unpackbits(raw, bitorder="little")
    if flat[count * bits :].any():
        raise PayloadError(f"{what}: padding bits are not zero")
    fields = np.zeros((count, 8 * word.itemsize), dtype=np.uint8)
    fields[:, :bits] = flat[: count * bits].reshape(count, bits)
    return np.packbits(fields, axis=1, bitorder="little").view(word).reshape(count)


def _pack_sub_byte(codes: np.ndarray, bits: int) -> bytes:
    """Fast path for 1, 2 and 4-bit fields: whole fields per byte."""
    per_byte = 8 // bits
    padded = np.zeros(-(-codes.size // per_byte) * per_byte, dtype=np.uint8)
    padded[: codes.size] = codes
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits)[None, :]
    return np.bitwise_or.reduce(padded.reshape(-1, per_byte) << shifts, axis=1).astype(np.uint8).tobytes()


def _unpack_sub_byte(raw: np.ndarray, count: int, bits: int, what: str) -> np.ndarray:
    per_byte = 8 // bits
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits)[None, :]
    fields = ((raw[:, None] >> shifts) & np.uint8((1 << bits) - 1)).reshape(-1)
    if fields[count:].any():
        raise PayloadError(f"{what}: padding bits are not zero")
    return fields[:count]
