"""Compact codes for sorted, distinct indices of transmitted entries.

Indices become gaps (``idx[i] - idx[i-1] - 1``, the first gap is ``idx[0]``)
and the gaps are written as LEB128 varints or as a Golomb-Rice code. Both
are vectorised with numpy and both decoders check every bound against
``numel`` before allocating anything.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from compression.buffers import Reader, pack_codes, packed_size, unpack_codes
from compression.errors import PayloadError


def indices_to_gaps(indices: np.ndarray) -> np.ndarray:
    """Gaps between sorted distinct indices, as uint64."""
    return (np.diff(indices.astype(np.int64), prepend=-1) - 1).astype(np.uint64)


def gaps_to_indices(gaps: np.ndarray, numel: int) -> np.ndarray:
    """Inverse of ``indices_to_gaps``; an index past ``numel`` is a ``PayloadError``."""
    if gaps.size and int(gaps.max()) >= numel:
        raise PayloadError(f"index gap {int(gaps.max())} is out of range for {numel} values")
    indices = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if indices.size and indices[-1] >= numel:
        raise PayloadError(f"index {int(indices[-1])} is out of range for {numel} values")
    return indices


def _bit_length(value: int) -> int:
    return max(int(value).bit_length(), 1)


# ---- LEB128 varint -------------------------------------------------------

def _varint_lengths(values: np.ndarray) -> np.ndarray:
    lengths = np.ones(values.shape, dtype=np.int64)
    for shift in range(7, 64, 7):
        lengths += values >= np.uint64(1 << shift)
    return lengths


def varint_encode(values: np.ndarray) -> bytes:
    """LEB128: 7 bits per byte, low group first, high bit set on all but the last byte."""
    values = values.astype(np.uint64)
    lengths = _varint_lengths(values)
    starts = np.cumsum(lengths) - lengths
    out = np.zeros(int(lengths.sum()), dtype=np.uint8)
    for j in range(int(lengths.max(initial=0))):
        live = lengths > j
        group = (values[live] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = (lengths[live] > j + 1).astype(np.uint64) << np.uint64(7)
        out[starts[live] + j] = (group | more).astype(np.uint8)
    return out.tobytes()


def varint_decode(reader: Reader, count: int, max_value: int) -> np.ndarray:
    """Read exactly ``count`` canonical varints, none longer than ``max_value`` needs."""
    if count == 0:
        return np.zeros(0, dtype=np.uint64)
    max_len = -(-_bit_length(max_value) // 7)
    window = np.frombuffer(reader.peek(count * max_len), dtype=np.uint8)
    ends = np.flatnonzero(window < 0x80)[:count]
    if ends.size < count:
        raise PayloadError(f"varint stream: found {ends.size} of {count} values in {window.size} bytes")
    starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64)
    lengths = ends - starts + 1
    if lengths.size and lengths.max() > max_len:
        raise PayloadError(f"varint stream: a value is longer than {max_len} bytes")
    if np.any(window[ends[lengths > 1]] == 0):
        raise PayloadError("varint stream: non-canonical (overlong) encoding")
    used = int(ends[-1]) + 1
    groups = (window[:used] & 0x7F).astype(np.uint64)
    position = np.arange(used, dtype=np.int64) - np.repeat(starts, lengths)
    shifted = groups << (np.uint64(7) * position.astype(np.uint64))
    reader.take(used, "varint stream")
    return np.add.reduceat(shifted, starts)


# ---- Golomb-Rice ---------------------------------------------------------
# Layout: u8 rice parameter b, u32 byte length of the unary part, the unary
# quotients (q ones then a zero each, packed LSB first), then the b-bit
# remainders packed back to back. Splitting quotients from remainders keeps
# decoding vectorised: the zeros of the unary part mark value boundaries.

def _rice_parameter(gaps: np.ndarray, numel: int) -> int:
    costs = [int((gaps >> np.uint64(b)).sum()) + gaps.size * (b + 1) for b in range(_bit_length(numel) + 1)]
    return int(np.argmin(costs))


def rice_encode(gaps: np.ndarray, numel: int) -> bytes:
    gaps = gaps.astype(np.uint64)
    b = _rice_parameter(gaps, numel) if gaps.size else 0
    quotients = (gaps >> np.uint64(b)).astype(np.int64)
    unary = np.ones(int(quotients.sum()) + gaps.size, dtype=np.uint8)
    unary[np.cumsum(quotients + 1) - 1] = 0
    unary_bytes = np.packbits(unary, bitorder="little").tobytes()
    remainders = pack_codes(gaps & np.uint64((1 << b) - 1), b) if b else b""
    return bytes([b]) + len(unary_bytes).to_bytes(4, "little") + unary_bytes + remainders


def rice_decode(reader: Reader, count: int, numel: int) -> np.ndarray:
    b, unary_len = reader.unpack("BI", "rice header")
    if b > _bit_length(numel):
        raise PayloadError(f"rice parameter {b} is too large for {numel} values")
    # The quotients of gaps that fit in numel sum to at most numel >> b.
    limit = packed_size((numel >> b) + count, 1)
    if unary_len > limit:
        raise PayloadError(f"rice unary part of {unary_len} bytes exceeds the bound {limit}")
    unary = np.unpackbits(np.frombuffer(reader.take(unary_len, "rice unary part"), np.uint8), bitorder="little")
    stops = np.flatnonzero(unary == 0)[:count]
    if stops.size < count:
        raise PayloadError(f"rice unary part holds {stops.size} of {count} values")
    used = int(stops[-1]) + 1 if count else 0
    if packed_size(used, 1) != unary_len or unary[used:].any():
        raise PayloadError("rice unary part has trailing bits")
    quotients = (np.diff(stops, prepend=-1) - 1).astype(np.uint64)
    if not b:
        return quotients
    remainders = unpack_codes(reader.take(packed_size(count, b), "rice remainders"), count, b, "rice remainders")
    return (quotients << np.uint64(b)) | remainders.astype(np.uint64)


@dataclasses.dataclass(frozen=True)
class IndexCoding:
    """A way to write sorted distinct indices below ``numel``."""

    encode_gaps: Callable[[np.ndarray, int], bytes]
    decode_gaps: Callable[[Reader, int, int], np.ndarray]

    def encode(self, indices: np.ndarray, numel: int) -> bytes:
        return self.encode_gaps(indices_to_gaps(indices), numel)

    def decode(self, reader: Reader, count: int, numel: int) -> np.ndarray:
        """Read ``count`` indices; ``count`` must already be bounded by ``numel``."""
        return gaps_to_indices(self.decode_gaps(reader, count, numel), numel)


INDEX_CODINGS: dict[str, IndexCoding] = {
    "varint": IndexCoding(lambda gaps, numel: varint_encode(gaps), lambda r, c, n: varint_decode(r, c, n)),
    "rice": IndexCoding(rice_encode, rice_decode),
}
