"""Compiled loops (numba) over a whole blockwise-int8 update body: its check and norm, and a fedbuff step's add.

Why: after three rounds of vectorising with numpy and torch (docs/history/scale.md), both hot loops of a push were
per-call overhead over the 336 small tensors of a Qwen2-0.5B LoRA update, not arithmetic: a 64k-value chunk
is 25-38 us of work, and every tensor cost a handful of calls on top. Here each is one call that walks the
body's bytes in place (no staging copy, no float32 temporary) and releases the GIL, so the coordinator's
other threads run beside it.

The layout of a clean int8 body follows from the manifest and the codec config alone (``wire``'s framing:
header, then per tensor a u32 length, the block scales, the codes), so it is computed once per (manifest,
config) and the kernels check every length prefix against it instead of indexing the body first. Anything
that does not match (another codec, bad framing, a code of -128, a negative, NaN or huge scale) makes the
kernels answer "not clean", and the caller takes the per-tensor path, which raises the 4xx it always did.

Same numbers as before: decoding is ``float32(code) * scale`` in float32 as ``int8_decode`` computes it, and
the step adds it with one fused multiply-add per value, which is what torch's ``add_(values, alpha=alpha)``
does on this CPU (its vectorised loop, remainders included, is ``fmadd``; tests compare the two bit for bit).
The norm sums exact per-block integer sums of squares times ``scale^2`` in float64, in order (the old path
summed the same terms pairwise: the two agree to float64 rounding).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from compression import wire
from compression.codecs.blockwise import BlockwiseConfig

_FP32_MAX = float(np.finfo(np.float32).max)
_MAGIC = tuple(wire.MAGIC)  # constants frozen into the compiled _frame_ok: the framing is wire's
_VERSION = wire.FORMAT_VERSION
GROUP_VALUES = 1 << 17
"""Weights a step adds all its updates to before moving on: 512 KiB of float32, half this CPU's L2 cache."""


@dataclass(frozen=True)
class Layout:
    """Where everything lies in a clean int8 body of one manifest and config (numpy arrays, one entry per tensor)."""

    size: int
    """Bytes of the whole body."""
    length_at: np.ndarray
    """Offset of each tensor's u32 length prefix."""
    lengths: np.ndarray
    """The length each prefix must hold."""
    scales_at: np.ndarray
    codes_at: np.ndarray
    numels: np.ndarray
    block: int
    fp16: bool
    """Scales stored as float16 (else float32), little-endian."""

    def spans(self) -> list[tuple[int, int]]:
        """(offset, length) of each tensor's codec payload, as ``wire.index_update_file`` gives them."""
        return [(int(a) + 4, int(n)) for a, n in zip(self.length_at, self.lengths)]


def layout(manifest: Sequence[tuple[str, tuple[int, ...]]], config: BlockwiseConfig) -> Layout:
    """The layout of a clean int8 body of ``manifest`` encoded with ``config`` (cached)."""
    try:  # the manifest's own (name, shape) tuples as the key: no per-entry work when it is already hashable
        return _layout(tuple(manifest), config.block_size, config.scale_dtype)
    except TypeError:  # a shape given as a list
        return _layout(tuple((name, tuple(shape)) for name, shape in manifest), config.block_size, config.scale_dtype)


@functools.lru_cache(maxsize=64)
def _layout(manifest: tuple[tuple[str, tuple[int, ...]], ...], block: int, scale_dtype: str) -> Layout:
    scale_size = 2 if scale_dtype == "fp16" else 4
    n = len(manifest)
    length_at, lengths, scales_at, codes_at, numels = (np.empty(n, dtype=np.int64) for _ in range(5))
    position = wire.HEADER.size
    for t, (_, shape) in enumerate(manifest):
        numel = math.prod(shape)
        scale_bytes = -(-numel // block) * scale_size
        length_at[t], lengths[t], scales_at[t] = position, scale_bytes + numel, position + 4
        codes_at[t], numels[t] = position + 4 + scale_bytes, numel
        position += 4 + scale_bytes + numel
    return Layout(position, length_at, lengths, scales_at, codes_at, numels, block, scale_dtype == "fp16")


# --- LLVM intrinsics the loops need (bit casts of unaligned little-endian scales, fused multiply-add) ---

@intrinsic
def _f32_from_bits(typingctx, bits):
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return sig, codegen


@intrinsic
def _f32_from_half_bits(typingctx, bits):
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())  # exact
    return sig, codegen


@intrinsic
def _fma32(typingctx, a, b, c):
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f, [f, f, f]), "llvm.fma.f32")
        return builder.call(fn, args)
    return sig, codegen


@intrinsic
def _bytes_at(typingctx, address):
    sig = types.CPointer(types.uint8)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.IntType(8)))
    return sig, codegen


@intrinsic
def _codes_at(typingctx, address):
    sig = types.CPointer(types.int8)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.IntType(8)))
    return sig, codegen


@njit(nogil=True, cache=True, inline="always")
def _u32(body, at):
    return (np.uint32(body[at]) | (np.uint32(body[at + 1]) << np.uint32(8)) | (np.uint32(body[at + 2]) << np.uint32(16))
            | (np.uint32(body[at + 3]) << np.uint32(24)))


@njit(nogil=True, cache=True, inline="always")
def _scale(body, scales_at, b, fp16):
    if fp16:
        at = scales_at + 2 * b
        return _f32_from_half_bits(np.uint16(body[at]) | (np.uint16(body[at + 1]) << np.uint16(8)))
    return _f32_from_bits(_u32(body, scales_at + 4 * b))


@njit(nogil=True, cache=True)
def _frame_ok(body, length_at, lengths):
    """Magic, version, tensor count and every length prefix as the layout says (the size is checked by the caller)."""
    for i in range(4):
        if body[i] != _MAGIC[i]:
            return False
    if body[4] != _VERSION:
        return False
    if _u32(body, 5) != length_at.size:
        return False
    for t in range(length_at.size):
        if _u32(body, length_at[t]) != lengths[t]:
            return False
    return True


@njit(nogil=True, cache=True)
def _norm_squared(body, codes, length_at, lengths, scales_at, codes_at, numels, block, fp16):
    """Sum over blocks of scale^2 * sum of code^2 (float64), or -1.0 if the body is not clean int8."""
    if not _frame_ok(body, length_at, lengths):
        return -1.0
    total = 0.0
    largest = 0.0
    for t in range(numels.size):
        numel, first = numels[t], codes_at[t]
        for b in range((numel + block - 1) // block):
            scale = _scale(body, scales_at[t], b, fp16)
            if not (scale >= 0.0 and scale <= _FP32_MAX):  # NaN fails both
                return -1.0
            largest = max(largest, np.float64(scale))
            end = min((b + 1) * block, numel)
            squares = np.int64(0)
            start = b * block
            while start < end:  # int32 sums of at most 2^16 squares (< 2^31), then int64: exact for any block
                stop = min(end, start + 65536)
                part = np.int32(0)
                low = np.int32(0)
                chunk = codes[first + start:first + stop]
                for j in range(stop - start):
                    c = np.int32(chunk[j])
                    part += c * c
                    low = min(low, c)
                if low < -127:
                    return -1.0
                squares += part
                start = stop
            s = np.float64(scale)
            total += s * s * np.float64(squares)
    if largest * 127.0 > _FP32_MAX:  # a decoded value could overflow float32
        return -1.0
    return total


@njit(nogil=True, cache=True)
def _add(weights, weights_at, codes, body, alpha, scales_at, codes_at, numels, block, fp16, first, last):
    """``weights[weights_at[t]:][:numel] += alpha * decoded tensor t`` for tensors first..last-1, one fused
    multiply-add per value, as torch's ``add_(decoded, alpha=alpha)`` computes it."""
    for t in range(first, last):
        numel, at, source = numels[t], weights_at[t], codes_at[t]
        for b in range((numel + block - 1) // block):
            scale = _scale(body, scales_at[t], b, fp16)
            low, high = b * block, min((b + 1) * block, numel)
            out, code = weights[at + low:at + high], codes[source + low:source + high]
            for j in range(high - low):  # slices indexed from 0 up: no negative-index wrap, so LLVM vectorises
                out[j] = _fma32(np.float32(code[j]) * scale, alpha, out[j])


@njit(nogil=True, cache=True)
def _add_all(weights, weights_at, addresses, sizes, alphas, scales_at, codes_at, blocks, fp16s, numels, group_ends):
    """``_add`` of every body (``addresses[k]``: its first byte, kept alive by the caller) to every group of
    tensors in turn (group g is tensors ``group_ends[g-1]..group_ends[g]-1``), all in one call: the GIL is let go
    once per step, not once per group and body."""
    first = 0
    for g in range(group_ends.size):
        last = group_ends[g]
        for k in range(addresses.size):
            body = carray(_bytes_at(addresses[k]), (sizes[k],))
            codes = carray(_codes_at(addresses[k]), (sizes[k],))
            _add(weights, weights_at, codes, body, alphas[k], scales_at[k], codes_at[k], numels, blocks[k], fp16s[k],
                 first, last)
        first = last


def norm(data: memoryview, lay: Layout) -> float | None:
    """The L2 norm of a clean int8 body laid out as ``lay``; None if it is not one (take the generic path)."""
    if len(data) != lay.size:
        return None
    body = np.frombuffer(data, dtype=np.uint8)
    squared = _norm_squared(body, body.view(np.int8), lay.length_at, lay.lengths, lay.scales_at, lay.codes_at,
                            lay.numels, lay.block, lay.fp16)
    if squared < 0:
        return None
    value = math.sqrt(squared)
    return value if math.isfinite(value) else None


def frame_ok(data: memoryview, lay: Layout) -> bool:
    """Whether the body's framing is exactly ``lay``'s (size, header, length prefixes; payloads not read)."""
    return len(data) == lay.size and bool(_frame_ok(np.frombuffer(data, dtype=np.uint8), lay.length_at, lay.lengths))


def add_updates(weights: np.ndarray, weights_at: np.ndarray, bodies: Sequence[tuple[memoryview, Layout, float]]) -> bool:
    """For each ``(body, layout, alpha)`` in order (bodies of one manifest, their configs may differ), every
    tensor of ``weights`` (float32, flat; tensor t starts at ``weights_at[t]``) += alpha * its decoded values;
    False, with nothing added, unless every body is clean int8.

    A group of tensors (about ``GROUP_VALUES`` weights) gets every body's values while it is in cache: each
    weight gets the same additions in the same order as body after body, so the result is the same floats."""
    arrays = []
    for data, lay, weight in bodies:
        if len(data) != lay.size or lay.numels.size != weights_at.size:
            return False
        body = np.frombuffer(data, dtype=np.uint8)
        codes = body.view(np.int8)
        if _norm_squared(body, codes, lay.length_at, lay.lengths, lay.scales_at, lay.codes_at, lay.numels, lay.block,
                         lay.fp16) < 0:  # not clean int8 (the squares it also sums cost little beside the reads)
            return False
        arrays.append((body, codes, lay, np.float32(weight)))  # torch's add_ casts alpha to the tensor's float32
    if not arrays:
        return True
    numels = arrays[0][2].numels
    ends: list[int] = []
    held = GROUP_VALUES  # tensors [previous end, end) make one group of about GROUP_VALUES weights
    for t, numel in enumerate(numels.tolist()):
        if ends and held + numel <= GROUP_VALUES:
            held += numel
            ends[-1] = t + 1
        else:
            ends.append(t + 1)
            held = numel
    _add_all(weights, weights_at, np.array([body.ctypes.data for body, _, _, _ in arrays], dtype=np.int64),
             np.array([body.size for body, _, _, _ in arrays], dtype=np.int64),
             np.array([alpha for _, _, _, alpha in arrays], dtype=np.float32),
             np.stack([lay.scales_at for _, _, lay, _ in arrays]), np.stack([lay.codes_at for _, _, lay, _ in arrays]),
             np.array([lay.block for _, _, lay, _ in arrays], dtype=np.int64),
             np.array([lay.fp16 for _, _, lay, _ in arrays], dtype=np.bool_), numels, np.array(ends, dtype=np.int64))
    return True


def warm_up() -> None:
    """Compile the kernels (or load them from numba's cache next to this file) for the argument types the server
    uses: a first call costs 0.5 s with the cache and ~3 s without, which the first push would otherwise wait for."""
    lay = _layout((("w", (3, 5)),), 4, "fp32")
    body = bytearray(lay.size)
    body[:9] = wire.HEADER.pack(wire.MAGIC, wire.FORMAT_VERSION, 1)
    body[9:13] = int(lay.lengths[0]).to_bytes(4, "little")
    data = memoryview(bytes(body))  # read-only, as a mapped file is
    norm(data, lay)
    frame_ok(data, lay)
    add_updates(np.zeros(15, dtype=np.float32), np.zeros(1, dtype=np.int64), [(data, lay, 1.0)])
