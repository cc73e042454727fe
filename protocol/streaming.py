"""Safetensors without whole-body copies: strict header parsing, zero-copy views, chunked checks.

Why not ``safetensors.torch.load``: it needs the body as ``bytes`` and copies every tensor out
of it, so a 1 GiB pull held ~3 GiB at once. Here a pulled body is read straight into one
preallocated buffer and its tensors are views into it (one copy of the bytes, ever), and a
pushed file is checked tensor by tensor in fixed-size chunks (memory does not grow with the
model). The header is parsed as strictly as the Rust parser does it: JSON object, known dtypes,
shapes that match their byte ranges, ranges that tile the data section exactly. Never pickle.
"""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import SafetensorError, safe_open

from protocol.errors import InvalidPayload, InvalidUpdate
from protocol.tensors import Manifest, StateDict

MAX_HEADER = 100_000_000  # the safetensors library's own limit
CHECK_CHUNK = 8 << 20  # bytes of one tensor checked at a time
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class Entry:
    """One tensor as the header describes it; offsets are relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    entries: list[Entry]
    data_start: int
    """Byte offset of the data section in the file (8 + header length)."""
    data_size: int

    @property
    def manifest(self) -> Manifest:
        return sorted((e.name, e.shape) for e in self.entries)


def parse_header(read: BinaryIO | bytes | bytearray | memoryview, total_size: int) -> Header:
    """Parse and check a safetensors header, given a reader (or the buffer) and the body's size."""
    prefix = _take(read, 0, 8)
    if len(prefix) < 8:
        raise InvalidPayload("body is not a valid safetensors file: shorter than its 8-byte header length")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER or 8 + length > total_size:
        raise InvalidPayload(f"body is not a valid safetensors file: header length {length} does not fit "
                             f"a body of {total_size} bytes")
    try:
        raw = json.loads(bytes(_take(read, 8, length)).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidPayload(f"body is not a valid safetensors file: header is not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise InvalidPayload("body is not a valid safetensors file: header is not a JSON object")
    metadata = raw.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        # the loader's rule (safetensors: Option<HashMap<String, String>>); {"x": 1} once passed here
        raise InvalidPayload("body is not a valid safetensors file: __metadata__ must map strings to strings")
    entries = sorted((_entry(name, spec) for name, spec in raw.items()), key=lambda e: (e.begin, e.end))
    data_size = total_size - 8 - length
    position = 0
    for e in entries:  # the ranges must tile the data section: no gaps, no overlaps, nothing past the end
        if e.begin != position:
            raise InvalidPayload(f"body is not a valid safetensors file: tensor {e.name!r} starts at {e.begin}, "
                                 f"expected {position}")
        position = e.end
    if position != data_size:
        raise InvalidPayload(f"body is not a valid safetensors file: tensors cover {position} bytes of a "
                             f"{data_size}-byte data section")
    return Header(entries, 8 + length, data_size)


def _take(read: BinaryIO | bytes | bytearray | memoryview, offset: int, size: int) -> bytes | memoryview:
    if isinstance(read, (bytes, bytearray, memoryview)):
        return memoryview(read)[offset:offset + size]
    return read.read(size)


def _entry(name: str, spec: object) -> Entry:
    bad = InvalidPayload(f"body is not a valid safetensors file: bad header entry for {name!r}")
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise bad
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if (not isinstance(dtype, str) or dtype not in DTYPES or not isinstance(shape, list)
            or not isinstance(offsets, list) or len(offsets) != 2):
        raise bad
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in [*shape, *offsets]):
        raise bad
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPES[dtype].itemsize:
        raise InvalidPayload(f"body is not a valid safetensors file: tensor {name!r} of shape {shape} "
                             f"({dtype}) does not fill bytes {begin}..{end}")
    return Entry(name, dtype, tuple(shape), begin, end)


def tensors_from_buffer(buf: bytearray) -> StateDict:
    """The tensors of a safetensors body as views into ``buf`` (no copy); InvalidPayload if malformed."""
    header = parse_header(buf, len(buf))
    tensors = {}
    for e in header.entries:
        count = (e.end - e.begin) // DTYPES[e.dtype].itemsize
        offset = header.data_start + e.begin
        if count == 0:
            tensors[e.name] = torch.empty(e.shape, dtype=DTYPES[e.dtype])
        elif offset % DTYPES[e.dtype].itemsize:  # a hand-made file may misalign; views need alignment
            copy = bytearray(buf[offset:offset + e.end - e.begin])
            tensors[e.name] = torch.frombuffer(copy, dtype=DTYPES[e.dtype]).reshape(e.shape)
        else:
            tensors[e.name] = torch.frombuffer(buf, dtype=DTYPES[e.dtype], count=count,
                                               offset=offset).reshape(e.shape)
    return tensors


def read_header(path: Path) -> Header:
    """The header of a safetensors file, accepted only if the safetensors loader itself opens it.

    A file is stored once and loaded by ``safe_open`` later (aggregation, gateway, restarts), so
    its rules are the ones that count: asking it here means nothing passes our check and fails
    there. Our own parse then adds what it does not check (tiling, our dtypes).
    """
    try:
        with safe_open(str(path), framework="pt") as f:
            f.metadata()
    except (SafetensorError, ValueError, TypeError) as exc:
        raise InvalidPayload(f"body is not a valid safetensors file: {exc}") from None
    with open(path, "rb") as f:
        return parse_header(f, path.stat().st_size)


def check_file(path: Path, manifest: Manifest) -> None:
    """Check a safetensors file against an expert's manifest in bounded memory.

    Names, shapes and dtype (float32) come from the header; finiteness is checked reading
    each tensor in ``CHECK_CHUNK`` pieces, so a 1 GiB update costs 8 MiB of memory, not 1 GiB.
    Raises InvalidPayload (malformed) or InvalidUpdate (does not fit the expert).
    """
    header = check_header(path, manifest)
    chunk = bytearray(CHECK_CHUNK)
    with open(path, "rb", buffering=0) as f:
        for e in header.entries:
            f.seek(header.data_start + e.begin)
            for start in range(e.begin, e.end, CHECK_CHUNK):
                n = f.readinto(memoryview(chunk)[:min(CHECK_CHUNK, e.end - start)])
                if not bool(torch.isfinite(torch.frombuffer(chunk, dtype=torch.float32, count=n // 4)).all()):
                    raise InvalidUpdate(f"tensor {e.name!r} contains NaN or Inf")


def check_header(path: Path, manifest: Manifest):
    """The file's header, checked against the manifest (names, shapes, float32); the data is not read."""
    header = read_header(path)
    by_name = {e.name: e for e in header.entries}
    expected = dict(manifest)
    missing, unknown = sorted(set(expected) - set(by_name)), sorted(set(by_name) - set(expected))
    if missing or unknown:
        raise InvalidUpdate(f"tensor names do not match the expert: missing {missing[:3]}, unexpected "
                            f"{unknown[:3]} ({len(missing)} and {len(unknown)} in all)",
                            missing=missing[:20], unexpected=unknown[:20])
    for name, shape in manifest:
        e = by_name[name]
        if e.shape != tuple(shape):
            raise InvalidUpdate(f"tensor {name!r} has shape {list(e.shape)}, expected {list(shape)}")
        if e.dtype != "F32":
            raise InvalidUpdate(f"tensor {name!r} has dtype {e.dtype}, expected float32 (F32)")
    return header


class FileTensors(Mapping[str, torch.Tensor]):
    """The tensors of a safetensors file, each read only when asked for (one at a time in memory)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._names = [e.name for e in read_header(path).entries]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        with safe_open(str(self.path), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class FileTensorsOnce(FileTensors):
    """``FileTensors`` that an aggregation reads in one pass: ``decoded_items`` (what
    ``coordinator.aggregation.base.tensors_of`` uses) yields every tensor, in file order, through one open file.
    ``FileTensors`` opens the file again for each tensor read, which for 15 stored smollm2-135m updates (420
    tensors each) took 2.7 of a relay batch's CPU seconds (docs/history/wan.md)."""

    def decoded_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        with safe_open(str(self.path), framework="pt") as f:
            for name in self:
                yield name, f.get_tensor(name)
