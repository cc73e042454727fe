"""Body digests: the client names the digest of what it sends, the coordinator checks it while streaming.

Header ``X-FedMoE-Digest: blake3=<64 hex digits>`` (clients since 0.7) or ``sha256=<64 hex digits>``
(older clients; still accepted). It catches bodies cut short or altered on the way (a proxy, a bug,
a disk error on the sender) before anything is stored; TLS is what stops a deliberate attacker.

Why BLAKE3: SHA-256 ran at 1.8 GB/s here, slower than the loopback socket (4.4 GB/s), so a 1 GiB
push spent more time hashing than moving bytes (issue 18). BLAKE3 is a cryptographic hash too
(256-bit, the same collision margin for our purpose) and runs several times faster on one core.

Content ids: the blob store names a blob by the digest of its bytes. A SHA-256 id is the bare hex
(every data dir before 0.7); a BLAKE3 id is ``b3-<hex>``. Both kinds live side by side, so an old
data dir needs no migration; ``algorithm_of`` tells which hash to check a blob (or an ETag) with.
Version story: a 0.7 client sends BLAKE3; a coordinator older than 0.7 answers 400 naming only the
sha256 form, and the client then resends with SHA-256 and keeps using it (protocol/client/transport.py).
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, Protocol

import blake3

from protocol.errors import BadRequest, RequestTimeout

DIGEST_HEADER = "X-FedMoE-Digest"
DEFAULT_ALGORITHM = "blake3"
ALGORITHMS = ("blake3", "sha256")
_PREFIX = {"blake3": "b3-", "sha256": ""}
_FORMAT = re.compile(r"(blake3|sha256)=([0-9a-f]{64})")
_ID = re.compile(r"(b3-)?([0-9a-f]{64})")
HASH_CHUNK = 1 << 20
MULTITHREAD_FROM = 8 << 20  # BLAKE3's own threads pay off only on large inputs


def new_hasher(algorithm: str, size_hint: int = 0) -> Any:
    """A hashlib-style object (update, hexdigest) for ``algorithm``."""
    if algorithm == "blake3":
        return blake3.blake3(max_threads=blake3.blake3.AUTO if size_hint >= MULTITHREAD_FROM else 1)
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algorithm!r}; known: {ALGORITHMS}")


def content_id(algorithm: str, hexdigest: str) -> str:
    """The id a blob with this digest is stored under (bare hex for SHA-256, ``b3-<hex>`` for BLAKE3)."""
    return _PREFIX[algorithm] + hexdigest


def algorithm_of(cid: str) -> str:
    return "blake3" if cid.startswith("b3-") else "sha256"


def hex_of(cid: str) -> str:
    return cid[3:] if cid.startswith("b3-") else cid


def is_content_id(text: str) -> bool:
    return _ID.fullmatch(text) is not None


def hash_bytes(data: bytes | bytearray | memoryview, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The content id of ``data``."""
    hasher = new_hasher(algorithm, len(data))
    hasher.update(data)
    return content_id(algorithm, hasher.hexdigest())


def hash_file(path: Path, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The content id of a file's bytes (BLAKE3 maps the file and uses its threads on large ones)."""
    size = path.stat().st_size
    hasher = new_hasher(algorithm, size)
    if algorithm == "blake3" and size:
        hasher.update_mmap(path)
    else:
        with open(path, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                hasher.update(chunk)
    return content_id(algorithm, hasher.hexdigest())


def digest_header(data: bytes | bytearray | memoryview, algorithm: str = DEFAULT_ALGORITHM) -> str:
    return f"{algorithm}=" + hex_of(hash_bytes(data, algorithm))


def parse_digest(value: str) -> str:
    """The content id a header value names, or BadRequest saying the expected forms."""
    m = _FORMAT.fullmatch(value.strip().lower())
    if m is None:
        raise BadRequest(f"{DIGEST_HEADER} must be 'blake3=<64 hex digits>' or 'sha256=<64 hex digits>', "
                         f"got {value[:80]!r}")
    return content_id(m.group(1), m.group(2))


def requested_algorithm(value: str | None) -> str:
    """The algorithm a (possibly malformed) header asks for; the default when it names none we know."""
    m = _FORMAT.fullmatch((value or "").strip().lower())
    return m.group(1) if m else DEFAULT_ALGORITHM


def is_old_server_refusal(message: str) -> bool:
    """A coordinator before 0.7 refuses a BLAKE3 digest naming only the sha256 form."""
    return DIGEST_HEADER in message and "must be 'sha256=" in message


class Readable(Protocol):
    """A body to read from: a file, a request's input stream, a ``ClientReader``."""

    def read(self, size: int = ..., /) -> bytes: ...


class ClientReader:
    """Wraps a request body stream and turns a failed read into a 408.

    A read fails when the client stalls past the server's socket timeout or drops the
    connection; either way it is the client's doing, never a 5xx. (Disk errors happen on the
    write side and stay what they are.) The body's digest is computed by the blob store as
    it writes (coordinator.storage.blobs.BlobStore.receive), or by the front as it spools.
    """

    def __init__(self, stream: Readable) -> None:
        self.stream = stream

    def read(self, size: int = -1) -> bytes:
        try:
            return self.stream.read(size)
        except OSError as exc:
            raise RequestTimeout(f"the request body stopped arriving ({exc.__class__.__name__}); send it again") \
                from None
