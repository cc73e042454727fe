"""Check a blockwise-int8 update and take its L2 norm in one pass over its codes, without decoding it.

Why: on receipt the coordinator only needs to know that a push decodes to finite tensors of the
expert's shapes, and its norm (``--norm-check``). The generic path decodes every tensor to float32
(4.4M values for a Qwen2-0.5B LoRA r=8 update), checks finiteness twice and takes the norm: about
ten passes over 17.6 MB per push, the largest cost of a push in the profile (docs/scale.md). For the
int8 codec every decoded value is ``code * scale`` of its block, so

    ||delta||^2 = sum over blocks b of scale_b^2 * sum_{i in b} code_i^2

is computed from the 1-byte codes (int16 squares, int32 sums per block) and the block scales, and
the output is finite exactly when ``127 * max(scale)`` is (checked in float32, as decode computes).
Anything unusual (another codec, a payload that does not frame exactly, a code of -128, a scale
that is negative, NaN or Inf, a product that could overflow) falls back to the generic decode,
which raises the 4xx it always raised: this path accepts nothing the full decode would refuse.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from compression import wire
from compression.codecs.blockwise import SCALE_FORMATS, BlockwiseConfig
from compression.errors import CompressionError
from protocol.errors import InvalidUpdate
from protocol.streaming import CHECK_CHUNK, check_header
from protocol.tensors import Manifest

FUSED_CODECS = ("int8",)
_FP32_MAX = float(np.finfo(np.float32).max)


def int8_config(codec: str, codec_config: dict) -> BlockwiseConfig | None:
    """The int8 codec's config if ``codec`` is plain int8 with a valid config, else None."""
    if codec not in FUSED_CODECS:
        return None
    try:
        return BlockwiseConfig(**codec_config)
    except (TypeError, CompressionError):
        return None  # the generic path words the 400


def int8_update_norm(path: Path, config: BlockwiseConfig, manifest: Manifest) -> float | None:
    """The update's L2 norm if every tensor is a clean int8 payload; None to take the generic path."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        try:
            spans = wire.index_update_file(f, size, manifest)
        except CompressionError:
            return None
        f.seek(0)
        data = f.read()
    view = memoryview(data)
    scale_dtype = np.dtype(SCALE_FORMATS[config.scale_dtype][0])
    scales, codes = [], []
    for (_, shape), (offset, length) in zip(manifest, spans):
        numel = math.prod(shape)
        parts = _int8_parts(view[offset:offset + length], numel, config.block_size, scale_dtype)
        if parts is None:
            return None
        scales.append(parts[0])
        codes.append(parts[1])
    return _norm(np.concatenate(scales), np.concatenate(codes), config.block_size)


def int8_decode_update(data: memoryview, spans: list[tuple[int, int]], config: BlockwiseConfig,
                       manifest: Manifest) -> dict[str, np.ndarray] | None:
    """Every tensor of an int8 update (float32, flat), decoded in one vectorised pass; None if any
    payload is not clean (the caller then decodes tensor by tensor, which raises the right error).

    Bit-identical to ``int8_decode`` per tensor (the same ``code * scale`` in float32), but one check
    and one multiply for the whole update instead of a handful of numpy calls for each of its 336
    small LoRA tensors: per-call overhead was most of a fedbuff step's decode (docs/scale.md).
    """
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
    if all_codes.size and (not (np.isfinite(all_scales).all() and (all_scales >= 0).all())
                           or all_codes.min() < -127 or float(all_scales.max()) * 127.0 > _FP32_MAX):
        return None
    values = np.empty(all_codes.size, dtype=np.float32)
    np.multiply(all_codes.reshape(-1, block), all_scales[:, None], out=values.reshape(-1, block))
    out, start = {}, 0
    for (name, _), numel, padded in zip(manifest, sizes, (c.size for c in codes)):
        out[name] = values[start:start + numel]
        start += padded
    return out


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


def _norm(scales: np.ndarray, codes: np.ndarray, block: int) -> float | None:
    """sqrt(sum_b scale_b^2 * sum codes^2 of block b), or None if decoding could refuse these values."""
    if codes.size == 0:
        return 0.0
    if not (np.isfinite(scales).all() and (scales >= 0).all()) or codes.min() < -127:
        return None
    if float(scales.max()) * 127.0 > _FP32_MAX:  # code * scale could overflow float32 in decode
        return None
    # Sums of up to 1024 squares of codes stay below 2^24, so float32 holds them exactly.
    wide = codes.astype(np.float32 if block <= 1024 else np.float64).reshape(-1, block)
    per_block = np.einsum("ij,ij->i", wide, wide)  # type: ignore[arg-type]  # numpy: astype(a or b) is typed dtype[generic]
    s64 = scales.astype(np.float64)
    norm = math.sqrt(float(np.dot(s64 * s64, per_block.astype(np.float64))))
    return norm if math.isfinite(norm) else None


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
