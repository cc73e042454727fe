"""Binary framing of a whole update: one codec payload per manifest tensor.

Layout, all little-endian::

    magic      4 bytes  b"FMC1"
    version    u8       FORMAT_VERSION
    count      u32      number of tensors, must equal len(manifest)
    then, for each manifest entry in order:
    length     u32      bytes of this tensor's codec payload
    payload    length bytes

Names and shapes are not sent: both sides hold the manifest.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import struct
from typing import BinaryIO

import torch

from compression.base import Codec, check_bytes, check_seed, derive_seed
from compression.buffers import Reader
from compression.errors import CompressionError, PayloadError

Manifest = list[tuple[str, tuple[int, ...]]]

MAGIC = b"FMC1"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sBI")
LENGTH = struct.Struct("<I")


@dataclasses.dataclass(frozen=True)
class UpdateStats:
    """Byte accounting of one update payload."""

    framing_bytes: int
    """Header plus per-tensor length prefixes."""
    index_bytes: int
    """Bytes the codec spent on positions of transmitted entries."""
    sent: int
    """Entries transmitted."""
    numel: int
    """Entries in the manifest."""


def check_manifest(manifest: Manifest) -> list[tuple[str, tuple[int, ...]]]:
    """Validate names (unique strings) and shapes (non-negative ints)."""
    entries = []
    for entry in manifest:
        try:
            name, shape = entry
            shape = tuple(operator.index(d) for d in shape)
        except (TypeError, ValueError) as exc:
            raise CompressionError(f"manifest entries are (name, shape) pairs, got {entry!r}") from exc
        if not isinstance(name, str) or any(d < 0 for d in shape):
            raise CompressionError(f"bad manifest entry {entry!r}")
        entries.append((name, shape))
    names = [name for name, _ in entries]
    if len(set(names)) != len(names):
        raise CompressionError("manifest names must be unique")
    return entries


def encode_update(
    tensors: dict[str, torch.Tensor], manifest: Manifest, codec: Codec, seed: int = 0
) -> bytes:
    """Encode every manifest tensor with ``codec`` into one framed payload."""
    entries = check_manifest(manifest)
    check_tensor_names(tensors, entries)
    seed = check_seed(seed)
    parts = [HEADER.pack(MAGIC, FORMAT_VERSION, len(entries))]
    for index, (name, shape) in enumerate(entries):
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise CompressionError(f"tensor {name!r} has shape {tuple(tensor.shape)}, manifest says {shape}")
        body = codec.encode(tensor, seed=derive_seed(seed, index), shape=shape)
        if len(body) > 0xFFFFFFFF:
            raise CompressionError(f"tensor {name!r} encodes to more than 4 GiB")
        parts += [LENGTH.pack(len(body)), body]
    return b"".join(parts)


def decode_update(payload: bytes, manifest: Manifest, codec: Codec) -> dict[str, torch.Tensor]:
    """Decode a framed payload into tensors shaped as the manifest says."""
    entries = check_manifest(manifest)
    out = {}
    for (name, shape), body in zip(entries, split_update(payload, entries)):
        out[name] = decode_tensor(body, name, shape, codec)
    return out


def inspect_update(payload: bytes, manifest: Manifest, codec: Codec) -> UpdateStats:
    """Byte accounting of a payload produced by ``encode_update`` with ``codec``."""
    entries = check_manifest(manifest)
    bodies = split_update(payload, entries)
    stats = [codec.inspect(body, math.prod(shape), shape) for (_, shape), body in zip(entries, bodies)]
    return UpdateStats(
        framing_bytes=HEADER.size + LENGTH.size * len(entries),
        index_bytes=sum(s.index_bytes for s in stats),
        sent=sum(s.sent for s in stats),
        numel=sum(math.prod(shape) for _, shape in entries),
    )


def _check_header(magic: bytes, version: int, count: int, manifest: Manifest) -> None:
    """The frame header must be this format's, for as many tensors as the manifest lists."""
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r}, expected {MAGIC!r}: not a compressed update")
    if version != FORMAT_VERSION:
        raise PayloadError(f"unsupported format version {version}, this build reads {FORMAT_VERSION}")
    if count != len(manifest):
        raise PayloadError(f"payload holds {count} tensors, manifest lists {len(manifest)}")


def split_update(payload: bytes, manifest: Manifest) -> list[memoryview]:
    """Check the framing and return one codec payload per manifest entry."""
    reader = Reader(check_bytes(payload))
    magic, version, count = reader.unpack("4sBI", "update header")
    _check_header(magic, version, count, manifest)
    bodies = []
    for name, _ in manifest:
        (length,) = reader.unpack("I", f"length of tensor {name!r}")
        bodies.append(reader.take(length, f"payload of tensor {name!r}"))
    reader.finish("update")
    return bodies


def index_update_file(f: BinaryIO, size: int, manifest: Manifest) -> list[tuple[int, int]]:
    """Check the framing of a payload stored in a file of ``size`` bytes, reading only its headers.

    Returns (offset, length) of each manifest entry's codec payload. The magic and version are
    checked before anything else is read, so a body that is not a compressed update costs 9 bytes
    of reading, not its size in memory (issue 13, defect 6).
    """
    header = f.read(HEADER.size)
    if len(header) < HEADER.size:
        raise PayloadError(f"update header: needs {HEADER.size} bytes but only {len(header)} remain")
    magic, version, count = HEADER.unpack(header)
    _check_header(magic, version, count, manifest)
    spans, position = [], HEADER.size
    for name, _ in manifest:
        f.seek(position)
        prefix = f.read(LENGTH.size)
        if len(prefix) < LENGTH.size:
            raise PayloadError(f"length of tensor {name!r}: needs {LENGTH.size} bytes but only "
                               f"{len(prefix)} remain")
        (length,) = LENGTH.unpack(prefix)
        position += LENGTH.size
        if length > size - position:
            raise PayloadError(f"payload of tensor {name!r}: needs {length} bytes but only {size - position} remain")
        spans.append((position, length))
        position += length
    if position != size:
        raise PayloadError(f"update: {size - position} unexpected trailing bytes")
    return spans


def decode_tensor(body: bytes | memoryview, name: str, shape: tuple[int, ...], codec: Codec) -> torch.Tensor:
    """Decode one tensor's codec payload (as framed by ``encode_update``) to its manifest shape."""
    try:
        return codec.decode(body, math.prod(shape), shape=shape).reshape(shape)
    except PayloadError as exc:
        raise PayloadError(f"tensor {name!r}: {exc}") from exc


def check_tensor_names(tensors: dict[str, torch.Tensor], entries: Manifest) -> None:
    """Raise unless the tensor names are exactly the manifest names."""
    expected = [name for name, _ in entries]
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise CompressionError(f"tensors do not match the manifest: missing {missing}, unexpected {extra}")
