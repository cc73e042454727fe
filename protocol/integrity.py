"""Body digests: the client names the SHA-256 of what it sends, the coordinator checks it while streaming.

Header ``X-FedMoE-Digest: sha256=<64 hex digits>``. It catches bodies cut short or altered on the
way (a proxy, a bug, a disk error on the sender) before anything is stored; TLS is what stops a
deliberate attacker on the wire.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from typing import BinaryIO

from protocol.errors import BadRequest

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


class HashingReader:
    """Wraps a body stream and hashes every byte read through it."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.sha256 = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        chunk = self.stream.read(size)
        self.sha256.update(chunk)
        return chunk

    def matches(self, expected_hex: str) -> bool:
        return hmac.compare_digest(self.sha256.hexdigest(), expected_hex)
