"""Check a blockwise-int8 update and take its L2 norm in one pass over its codes, without decoding it.

Why: on receipt the coordinator only needs to know that a push decodes to finite tensors of the
expert's shapes, and its norm (``--norm-check``). The generic path decodes every tensor to float32
(4.4M values for a Qwen2-0.5B LoRA r=8 update), checks finiteness twice and takes the norm: about
ten passes over 17.6 MB per push, the largest cost of a push in the profile (docs/history/scale.md). For the
int8 codec every decoded value is ``code * scale`` of its block, so

    ||delta||^2 = sum over blocks b of scale_b^2 * sum_{i in b} code_i^2

is computed from the 1-byte codes (exact integer sums of squares per block) and the block scales, and
the output is finite exactly when ``127 * max(scale)`` is (checked in float32, as decode computes). The
norm, and a fedbuff step's add into weights held in one buffer, run as compiled passes over the whole body
(``coordinator/checks/int8_kernel.py``); the numpy code here is the step's path for weights that are not flat.
Anything unusual (another codec, a payload that does not frame exactly, a code of -128, a scale
that is negative, NaN or Inf, a product that could overflow) falls back to the generic decode,
which raises the 4xx it always raised: this path accepts nothing the full decode would refuse.
"""
from __future__ import annotations

import contextlib
import math
import mmap
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from compression import wire
from compression.codecs.blockwise import SCALE_FORMATS, BlockwiseConfig
from compression.errors import CompressionError
from coordinator.checks import int8_kernel
from coordinator.checks.flat_weights import contiguous_range, flat_offsets
from protocol.errors import InvalidUpdate
from protocol.streaming import CHECK_CHUNK, check_header
from protocol.tensors import Manifest

FUSED_CODECS = ("int8",)
_FP32_MAX = float(np.finfo(np.float32).max)
CHUNK_VALUES = 1 << 16
"""Codes decoded at once by the numpy step path (weights not in one buffer): their float32 copy (256 KiB)
stays in the CPU's cache between passes."""


def int8_config(codec: str, codec_config: dict) -> BlockwiseConfig | None:
    """The int8 codec's config if ``codec`` is plain int8 with a valid config, else None."""
    if codec not in FUSED_CODECS:
        return None
    try:
        return BlockwiseConfig(**codec_config)
    except (TypeError, CompressionError):
        return None  # the generic path words the 400


@contextlib.contextmanager
def mapped(path: Path) -> Iterator[memoryview]:
    """The file's bytes, mapped read-only (the page cache is the only copy; nothing is read ahead of use)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield memoryview(b"")
            return
        whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(whole)
    try:
        yield view
    finally:
        with contextlib.suppress(BufferError):  # arrays still alive (an exception's frames): unmapped when freed
            view.release()
            whole.close()


class _ViewFile:
    """``read`` and ``seek`` over bytes in memory, for ``wire.index_update_file`` (which reads only headers)."""

    def __init__(self, data: memoryview) -> None:
        self.data, self.position = data, 0

    def seek(self, position: int) -> None:
        self.position = position

    def read(self, n: int) -> bytes:
        chunk = self.data[self.position:self.position + n].tobytes()
        self.position += len(chunk)
        return chunk


def index_update(data: memoryview, manifest: Manifest) -> list[tuple[int, int]]:
    """``wire.index_update_file`` over bytes already mapped (CompressionError if they do not frame)."""
    return wire.index_update_file(_ViewFile(data), len(data), manifest)  # type: ignore[arg-type]  # reads, seeks


def int8_update_norm(path: Path, config: BlockwiseConfig, manifest: Manifest) -> float | None:
    """The update's L2 norm if every tensor is a clean int8 payload; None to take the generic path.

    The file is mapped, not read (the page cache is the only copy), and checked and measured in one compiled
    pass over its bytes (``int8_kernel.norm``): no staging copy, no float temporary, one call per push
    instead of a few per tensor.
    """
    with mapped(path) as data:
        return int8_kernel.norm(data, int8_kernel.layout(manifest, config))


def _int8_views(data: memoryview, spans: list[tuple[int, int]], config: BlockwiseConfig,
                manifest: Manifest) -> tuple[list[np.ndarray], np.ndarray, list[int]] | None:
    """(per tensor its codes, an int8 view of ``data``; all block scales as float32; each tensor's first
    block, then the number of blocks) of an int8 update; None if a payload does not frame with this config."""
    scale_dtype = np.dtype(SCALE_FORMATS[config.scale_dtype][0])
    block = config.block_size
    codes, scales, block_starts = [], [], [0]
    for (_, shape), (offset, length) in zip(manifest, spans):
        numel = math.prod(shape)
        nblocks = -(-numel // block)
        scale_bytes = nblocks * scale_dtype.itemsize
        if length != scale_bytes + numel:
            return None
        scales.append(np.frombuffer(data, scale_dtype, nblocks, offset))
        codes.append(np.frombuffer(data, np.int8, numel, offset + scale_bytes))
        block_starts.append(block_starts[-1] + nblocks)
    return codes, np.concatenate(scales).astype(np.float32), block_starts


def _scales_clean(scales: np.ndarray) -> bool:
    """Decoding accepts these scales (finite, >= 0) and no ``code * scale`` can overflow float32."""
    return bool(np.isfinite(scales).all() and (scales >= 0).all()) and float(scales.max(initial=0.0)) * 127.0 <= _FP32_MAX


def int8_decode_update(data: memoryview, spans: list[tuple[int, int]], config: BlockwiseConfig,
                       manifest: Manifest) -> dict[str, np.ndarray] | None:
    """Every tensor of an int8 update (float32, flat), decoded in one vectorised pass; None if any
    payload is not clean (the caller then decodes tensor by tensor, which raises the right error).

    Bit-identical to ``int8_decode`` per tensor (the same ``code * scale`` in float32), but one check
    and one multiply for the whole update instead of a handful of numpy calls for each of its 336
    small LoRA tensors: per-call overhead was most of a fedbuff step's decode (docs/history/scale.md).
    """
    checked = _checked_update(data, spans, config, manifest)
    if checked is None:
        return None
    all_scales, all_codes, sizes = checked
    block = config.block_size
    values = np.empty(all_codes.size, dtype=np.float32)
    np.multiply(all_codes.reshape(-1, block), all_scales[:, None], out=values.reshape(-1, block))
    out, start = {}, 0
    for (name, _), numel in zip(manifest, sizes):
        out[name] = values[start:start + numel]
        start += _padded(numel, block)
    return out


def int8_add_updates(bodies: Sequence[tuple[memoryview, list[tuple[int, int]], BlockwiseConfig, float]],
                     manifest: Manifest, targets: Mapping[str, torch.Tensor]) -> bool:
    """For each ``(data, spans, config, alpha)`` of clean int8 updates of one manifest, in order,
    ``targets[name].add_(decoded, alpha=alpha)``; False, with nothing added, unless every body is clean.

    Targets that are views of one flat buffer (a step's weights, ``load_flat``) take the compiled pass
    (``int8_kernel.add_updates``: the same fused multiply-add per value as torch's ``add_``, bit-identical);
    other targets the numpy path below.

    The same additions, in the same order for every tensor, as ``int8_add_update`` body after body (so the
    result is bit-identical), but tensor group by tensor group: a group of targets (up to ``CHUNK_VALUES``
    values) gets every body's values while it is in cache, instead of each body's pass reading and writing
    every target in memory again (the weights of a Qwen2-0.5B LoRA expert are 17.6 MB; a fedbuff step adds K
    updates to them).
    """
    flat = flat_offsets([targets[name] for name, _ in manifest]) if manifest else None
    if flat is not None:  # the step's own weights, in one buffer (load_flat): one compiled pass per body
        weights, weights_at = flat
        return int8_kernel.add_updates(weights, weights_at, [(data, int8_kernel.layout(manifest, config), alpha)
                                                     for data, _, config, alpha in bodies])
    parsed = []
    for data, spans, config, alpha in bodies:
        clean = _clean_tensors(data, spans, config, manifest)
        if clean is None:
            return False
        parsed.append((clean, config.block_size, alpha))
    if not parsed:
        return True
    reach = max(block for _, block, _ in parsed) - 1  # a tensor's padded size is at most numel + reach
    numels = [math.prod(shape) for _, shape in manifest]
    size = max([CHUNK_VALUES] + [n + reach for n in numels])
    staged, values = np.empty(size, dtype=np.int8), np.empty(size, dtype=np.float32)
    staged_t, values_t = torch.from_numpy(staged), torch.from_numpy(values)
    first = 0
    while first < len(manifest):
        last, room = first + 1, size - numels[first] - reach  # tensors [first, last) make one group
        while last < len(manifest) and numels[last] + reach <= room:
            room -= numels[last] + reach
            last += 1
        segments = _segments(targets, manifest, numels, first, last)
        for (codes, scales, block_starts), block, alpha in parsed:
            at = 0
            for t in range(first, last):
                numel = numels[t]
                staged[at:at + numel] = codes[t]
                padded = numel if numel % block == 0 else _padded(numel, block)
                if padded != numel:
                    staged[at + numel:at + padded] = 0
                at += padded
            # code * scale in float32, as int8_decode computes it: exact cast, then one rounding per product
            # (torch's cast and broadcast multiply took 17 us per 64k values here, numpy's mixed-type one 25)
            wide = values_t[:at].view(-1, block)
            wide.copy_(staged_t[:at].view(-1, block))
            wide.mul_(torch.from_numpy(scales[block_starts[first]:block_starts[last], None]))
            at = 0
            for start, end, run in segments:
                if run is not None and all(numels[t] % block == 0 for t in range(start, end)):  # no padding inside
                    run.add_(torch.from_numpy(values[at:at + run.numel()]), alpha=alpha)
                    at += run.numel()
                    continue
                for t in range(start, end):
                    name, shape = manifest[t]
                    targets[name].add_(torch.from_numpy(values[at:at + numels[t]]).reshape(shape), alpha=alpha)
                    at += _padded(numels[t], block)
        first = last
    return True


def _segments(targets: Mapping[str, torch.Tensor], manifest: Manifest, numels: list[int], first: int,
              last: int) -> list[tuple[int, int, torch.Tensor | None]]:
    """Tensors ``first..last-1`` cut into runs ``(start, end, view)``: ``view`` is one flat view of targets
    ``start..end-1`` when they lie back to back in one buffer (``load_flat``) and each holds a multiple of 64
    values, else None (and the run is one tensor). One ``add_`` over such a run touches the very elements
    the per-tensor adds did in the same vectorised loop: no tensor of 64-multiple size ends in the scalar
    remainder of torch's loop, so the floats are the same (tested against adds per tensor)."""
    segments: list[tuple[int, int, torch.Tensor | None]] = []
    t = first
    while t < last:
        end = t
        while end < last and numels[end] % 64 == 0:
            end += 1
        run = contiguous_range([targets[name] for name, _ in manifest[t:end]]) if end - t > 1 else None
        if run is not None:
            segments.append((t, end, run))
            t = end
        else:
            segments.append((t, t + 1, None))
            t += 1
    return segments


def _clean_tensors(data: memoryview, spans: list[tuple[int, int]], config: BlockwiseConfig,
                   manifest: Manifest) -> tuple[list[np.ndarray], np.ndarray, list[int]] | None:
    """``_int8_views`` of a clean int8 update; None if a payload does not frame, or decoding could refuse
    (a code of -128, a bad scale) or overflow."""
    views = _int8_views(data, spans, config, manifest)
    if views is None:
        return None
    codes, scales, block_starts = views
    if block_starts[-1] and not (_scales_clean(scales) and np.concatenate(codes).min() >= -127):
        return None
    return views


def _checked_update(data: memoryview, spans: list[tuple[int, int]], config: BlockwiseConfig,
                    manifest: Manifest) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
    """(all block scales as float32, all codes each tensor padded to whole blocks, numel per tensor) of a
    clean int8 update; None if a payload does not frame, or decoding could refuse or overflow."""
    scale_dtype = np.dtype(SCALE_FORMATS[config.scale_dtype][0])
    block = config.block_size
    scales, codes, sizes = [], [], []
    for (_, shape), (offset, length) in zip(manifest, spans):
        numel = math.prod(shape)
        parts = _int8_parts(data[offset:offset + length], numel, block, scale_dtype)
        if parts is None:
            return None
        scales.append(parts[0])
        codes.append(parts[1])
        sizes.append(numel)
    all_scales, all_codes = np.concatenate(scales), np.concatenate(codes)
    if all_codes.size and not (_scales_clean(all_scales) and all_codes.min() >= -127):
        return None
    return all_scales, all_codes, sizes


def _padded(numel: int, block: int) -> int:
    return -(-numel // block) * block


def _int8_parts(payload: memoryview, numel: int, block: int, scale_dtype: np.dtype) -> tuple | None:
    """(block scales as float32, codes padded to whole blocks) of one tensor, or None if it does not frame."""
    nblocks = -(-numel // block)
    scale_bytes = nblocks * scale_dtype.itemsize
    if len(payload) != scale_bytes + numel:
        return None
    scales = np.frombuffer(payload[:scale_bytes], dtype=scale_dtype).astype(np.float32)
    codes = np.frombuffer(payload[scale_bytes:], dtype=np.int8)
    if numel % block:
        codes = np.concatenate([codes, np.zeros(nblocks * block - numel, dtype=np.int8)])
    return scales, codes


def int8_decode(payload: memoryview, numel: int, config: BlockwiseConfig) -> np.ndarray | None:
    """One tensor's values (float32, ``numel``), exactly as the int8 codec decodes them (code * scale of its
    block, in float32), in one pass; None if the payload is not clean (the caller then decodes it the
    generic way, which raises the right error). Finiteness follows from the scale check, not a pass."""
    scale_dtype = np.dtype(SCALE_FORMATS[config.scale_dtype][0])
    parts = _int8_parts(payload, numel, config.block_size, scale_dtype)
    if parts is None:
        return None
    scales, codes = parts
    if numel == 0:
        return np.zeros(0, dtype=np.float32)
    if not (np.isfinite(scales).all() and (scales >= 0).all()) or codes.min() < -127:
        return None
    if float(scales.max()) * 127.0 > _FP32_MAX:
        return None
    out = np.empty(codes.size, dtype=np.float32)
    np.multiply(codes.reshape(-1, config.block_size), scales[:, None], out=out.reshape(-1, config.block_size))
    return out[:numel]


def raw_update_norm(path: Path, manifest: Manifest) -> float:
    """Check an uncompressed (safetensors) update and take its L2 norm in one read of its data.

    The generic path read the file twice (``check_file``'s finiteness pass, then ``l2_norm`` over
    the tensors). A chunk whose float32 norm is finite holds only finite values; only a chunk whose
    norm is not finite is looked at again, to tell NaN/Inf (422) from a sum of squares that overflowed
    float32 (then summed in float64). Raises what ``check_file`` raises.
    """
    header = check_header(path, manifest)
    chunk = bytearray(CHECK_CHUNK)
    squares = 0.0
    with open(path, "rb", buffering=0) as f:
        for e in header.entries:
            f.seek(header.data_start + e.begin)
            for start in range(e.begin, e.end, CHECK_CHUNK):
                n = f.readinto(memoryview(chunk)[:min(CHECK_CHUNK, e.end - start)])
                values = torch.frombuffer(chunk, dtype=torch.float32, count=n // 4)
                norm = float(torch.linalg.vector_norm(values))
                if not math.isfinite(norm):
                    if not bool(torch.isfinite(values).all()):
                        raise InvalidUpdate(f"tensor {e.name!r} contains NaN or Inf")
                    norm = float(torch.linalg.vector_norm(values, dtype=torch.float64))
                squares += norm * norm
    return math.sqrt(squares)
