"""An expert's float32 weights read into one flat buffer, each tensor a view of it.

Why: a fedbuff step adds K decoded updates to every tensor of the current weights. With the tensors
in one buffer, in manifest order, consecutive tensors are one contiguous range, so a group of them
gets each update in one ``add_`` instead of one per tensor (336 per update for a Qwen2-0.5B LoRA
expert: torch's per-call overhead was a third of a step, docs/history/scale.md). It is also one read of the
file instead of a copy per tensor.

Only a plain file of float32 tensors laid out back to back is read this way; anything else (other
dtypes, gaps, a header we do not expect) returns None and the caller uses ``protocol.tensors.load_file``.
"""
from __future__ import annotations

import functools
import json
import math
import re
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from protocol.tensors import StateDict

_HEADER_LIMIT = 100 << 20  # safetensors' own limit on the JSON header


def load_flat(path: Path) -> StateDict | None:
    """The file's tensors (in the order ``load_file`` gives: by name) as views of one float32 buffer laid
    out as in the file; None if the file is not plain back-to-back float32 tensors."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        prefix = f.read(8)
        if len(prefix) < 8:
            return None
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > min(_HEADER_LIMIT, size - 8) or (8 + header_size) % 4:
            return None
        entries = _parsed_layout(f.read(header_size), size - 8 - header_size)
        if entries is None:
            return None
        data = bytearray(size - 8 - header_size)
        if f.readinto(data) != len(data):
            return None
    flat = torch.frombuffer(data, dtype=torch.float32) if data else torch.empty(0)
    return {name: flat[begin // 4:end // 4].view(shape) for name, shape, begin, end in entries}


@functools.lru_cache(maxsize=16)
def _parsed_layout(header: bytes, data_size: int) -> tuple[tuple[str, tuple[int, ...], int, int], ...] | None:
    """``_layout`` of a raw JSON header, by name, cached: every version of an expert has the same header, and
    parsing its 336 entries was a tenth of a step's Python time (docs/history/scale.md)."""
    try:
        entries = _layout(json.loads(header), data_size)
    except (UnicodeDecodeError, ValueError):
        return None
    return None if entries is None else tuple((name, *entries[name]) for name in sorted(entries))


def _layout(header: object, data_size: int) -> dict[str, tuple[tuple[int, ...], int, int]] | None:
    """name -> (shape, begin, end) if every tensor is float32 and they tile the data exactly, else None."""
    if not isinstance(header, dict):
        return None
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") != "F32":
            return None
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return None
        begin, end = offsets
        if end - begin != 4 * math.prod(shape) or begin % 4:
            return None
        entries[name] = (tuple(shape), begin, end)
    spans = sorted((begin, end) for _, begin, end in entries.values())
    if [b for b, _ in spans] != [0] + [e for _, e in spans[:-1]] or (spans[-1][1] if spans else 0) != data_size:
        return None  # gaps or overlaps
    return entries


def contiguous_range(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat float32 view covering ``tensors`` if they are consecutive views of one contiguous buffer
    (as ``load_flat`` makes them), in this order; else None."""
    first = tensors[0]
    base = first._base
    if base is None or first.dtype != torch.float32 or base.dtype != torch.float32 or not base.is_contiguous():
        return None
    expected = first.data_ptr()
    for t in tensors:
        if t._base is not base or not t.is_contiguous() or t.data_ptr() != expected:
            return None
        expected += 4 * t.numel()
    start = (first.data_ptr() - base.data_ptr()) // 4
    return base.view(-1)[start:start + (expected - first.data_ptr()) // 4]


def flat_offsets(tensors: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray] | None:
    """(the float32 buffer that every one of ``tensors`` is a contiguous view of, as a flat writable numpy array;
    where each tensor starts in it, in values) if there is one (``load_flat``'s tensors), else None."""
    if not tensors:
        return None
    base = tensors[0]._base
    if base is None or base.dtype != torch.float32 or not base.is_contiguous() or base.requires_grad:
        return None
    start, size = base.data_ptr(), base.numel()
    offsets = np.empty(len(tensors), dtype=np.int64)
    for i, t in enumerate(tensors):
        if t.numel() == 0 and t.dtype == torch.float32:  # nothing to reach (torch may give it a null data_ptr)
            offsets[i] = 0
            continue
        at, rest = divmod(t.data_ptr() - start, 4)
        if t._base is not base or t.dtype != torch.float32 or not t.is_contiguous() or rest or at < 0 \
                or at + t.numel() > size:
            return None
        offsets[i] = at
    flat = base.view(-1).numpy()
    return (flat, offsets) if flat.flags.writeable else None


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]+")  # JSON-encodes the same in every library: no escapes


def save_flat(tensors: Mapping[str, torch.Tensor], path: Path) -> bool:
    """Write ``tensors`` to ``path`` as the very bytes ``protocol.tensors.save_file`` writes (safetensors, empty
    metadata), straight from the one float32 buffer they tile in name order (``load_flat``'s tensors, after a
    step): one write of the buffer, no per-tensor work. False, with nothing written, for anything else.

    Why: safetensors' own writer spends Python time on each of the 336 tensors (pointer casts, a shared-memory
    check over every pair that shares the buffer), under the expert's lock, once per fedbuff step (docs/history/scale.md).
    """
    names = sorted(tensors)
    ordered = [tensors[name] for name in names]
    flat = flat_offsets(ordered)
    if flat is None or not all(_PLAIN_NAME.fullmatch(name) for name in names):
        return False
    buffer, offsets = flat
    entries, end = [], 0
    for name, t, at in zip(names, ordered, offsets.tolist()):
        if t.numel() and at != end:
            return False
        shape = ",".join(str(d) for d in t.shape)
        entries.append(f'"{name}":{{"dtype":"F32","shape":[{shape}],"data_offsets":[{4 * end},{4 * (end + t.numel())}]}}')
        end += t.numel()
    if end != buffer.size:
        return False
    header = ('{"__metadata__":{},' + ",".join(entries) + "}").encode() if entries else b'{"__metadata__":{}}'
    header += b" " * (-len(header) % 8)  # safetensors pads its header with spaces to a multiple of 8
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.write(buffer.data.cast("B"))
    return True
