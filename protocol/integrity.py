"""Body digests: the client names the SHA-256 of what it sends, the coordinator checks it while streaming.

Header ``X-FedMoE-Digest: sha256=<64 hex digits>``. It catches bodies cut short or altered on the
way (a proxy, a bug, a disk error on the sender) before anything is stored; TLS is what stops a
deliberate attacker on the wire.
"""
from __future__ import annotations

import hashlib
import re
from typing import IO, Protocol

from protocol.errors import BadRequest, RequestTimeout

DIGEST_HEADER = "X-FedMoE-Digest"
_FORMAT = re.compile(r"sha256=([0-9a-f]{64})")


def digest_header(data: bytes) -> str:
    return "sha256=" + hashlib.sha256(data).hexdigest()


def parse_digest(value: str) -> str:
    """The hex digest in a header value, or BadRequest saying the expected form."""
    m = _FORMAT.fullmatch(value.strip().lower())
    if m is None:
        raise BadRequest(f"{DIGEST_HEADER} must be 'sha256=<64 hex digits>', got {value[:80]!r}")
    return m.group(1)


class Readable(Protocol):
    """What a request body is read through: a file, a socket stream or a ClientReader."""

    def read(self, size: int = -1, /) -> bytes: ...


class ClientReader:
    """Wraps a request body stream and turns a failed read into a 408.

    A read fails when the client stalls past the server's socket timeout or drops the
    connection; either way it is the client's doing, never a 5xx. (Disk errors happen on the
    write side and stay what they are.) The body's SHA-256 is computed by the blob store as
    it writes (coordinator.blobs.BlobStore.receive).
    """

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream

    def read(self, size: int = -1) -> bytes:
        try:
            return self.stream.read(size)
        except OSError as exc:
            raise RequestTimeout(f"the request body stopped arriving ({exc.__class__.__name__}); send it again") \
                from None
