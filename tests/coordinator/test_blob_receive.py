"""Receiving a body: hashed while it arrives, exactly Content-Length bytes, never half-kept."""
from __future__ import annotations

import hashlib
import io

import blake3

import pytest

from coordinator.storage.blobs import BlobStore
from protocol.client import Chunks
from protocol.errors import BadRequest, PayloadTooLarge


class Trickle(io.BytesIO):
    """A stream that hands out at most 1000 bytes per read, like a socket, and has more after the body."""

    def read(self, size: int = -1) -> bytes:
        return super().read(min(1000, size if size >= 0 else 1000))


def test_digest_computed_while_receiving_is_the_blake3_of_the_body(tmp_path):
    store = BlobStore(tmp_path)
    body = bytes(range(256)) * 40_000  # ~10 MiB: several receive chunks
    tmp = store.receive(io.BytesIO(body), limit=len(body))
    digest = store.adopt(tmp)
    assert digest == "b3-" + blake3.blake3(body).hexdigest()
    assert store.path(digest) == tmp_path / digest[3:5] / digest
    assert store.path(digest).read_bytes() == body
    assert store.verify(digest)


def test_a_sha256_digest_names_blobs_as_before_0_7(tmp_path):
    store = BlobStore(tmp_path)
    body = b"old client" * 1000
    tmp = store.receive(io.BytesIO(body), limit=len(body), algorithm="sha256")
    digest = store.adopt(tmp)
    assert digest == hashlib.sha256(body).hexdigest()
    assert store.path(digest).read_bytes() == body
    assert store.verify(digest)
    store.path(digest).write_bytes(b"bit rot")
    assert not store.verify(digest)


def test_a_digest_of_another_algorithm_is_computed_from_the_file(tmp_path):
    store = BlobStore(tmp_path)
    body = b"x" * 5000
    tmp = store.receive(io.BytesIO(body), limit=len(body))
    assert store.digest_of(tmp, "sha256") == hashlib.sha256(body).hexdigest()
    assert store.digest_of(tmp) == "b3-" + blake3.blake3(body).hexdigest()


def test_with_a_length_exactly_that_many_bytes_are_read(tmp_path):
    store = BlobStore(tmp_path)
    stream = Trickle(b"x" * 2500 + b"NEXT REQUEST")
    tmp = store.receive(stream, limit=10_000, length=2500)
    assert tmp.read_bytes() == b"x" * 2500 and stream.read(100) == b"NEXT REQUEST"
    store.forget(tmp)
    assert not tmp.exists() and list(store.tmp_dir.iterdir()) == []


def test_a_body_shorter_than_its_length_or_over_the_limit_leaves_nothing(tmp_path):
    store = BlobStore(tmp_path)
    with pytest.raises(BadRequest, match="ended after 10 of its 20 bytes"):
        store.receive(io.BytesIO(b"y" * 10), limit=100, length=20)
    with pytest.raises(PayloadTooLarge):
        store.receive(io.BytesIO(b"z" * 200), limit=100)
    assert list(store.tmp_dir.iterdir()) == []


def test_client_chunks_are_views_that_cover_the_body_once_per_iteration():
    body = bytes(range(256)) * 70_000  # ~17 MiB: five 4 MiB chunks
    chunks = Chunks(body)
    assert len(chunks) == len(body)
    first, again = list(chunks), list(chunks)  # a retry sends it all again
    assert b"".join(first) == body == b"".join(again)
    assert [len(c) for c in first[:-1]] == [4 << 20] * (len(first) - 1)
    assert all(isinstance(c, memoryview) for c in first)
