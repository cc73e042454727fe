"""A compressed update read from a file: framing checked from its headers alone (issue 13, defect 6)."""
from __future__ import annotations

import io

import pytest
import torch

from compression.errors import PayloadError
from compression.registry import make_codec
from compression.wire import LENGTH, decode_tensor, decode_update, encode_update, index_update_file

MANIFEST = [("a", (64, 32)), ("b", (1000,)), ("c", (3, 5))]


class CountingFile(io.BytesIO):
    """A file that remembers how many bytes were read from it."""

    bytes_read = 0

    def read(self, n: int = -1) -> bytes:
        data = super().read(n)
        self.bytes_read += len(data)
        return data


def payload(codec: str = "fp16") -> bytes:
    g = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=g) for name, shape in MANIFEST}
    return encode_update(tensors, MANIFEST, make_codec(codec, {}))


@pytest.mark.parametrize("codec", ["fp16", "topk+int8"])
def test_tensors_decoded_one_by_one_equal_the_whole_decode(codec):
    body = payload(codec)
    f = CountingFile(body)
    spans = index_update_file(f, len(body), MANIFEST)
    assert f.bytes_read == 9 + LENGTH.size * len(MANIFEST)  # the headers only, never a payload
    whole = decode_update(body, MANIFEST, make_codec(codec, {}))
    for (name, shape), (offset, length) in zip(MANIFEST, spans):
        one = decode_tensor(body[offset:offset + length], name, shape, make_codec(codec, {}))
        assert torch.equal(one, whole[name])


def test_a_body_that_is_not_a_compressed_update_costs_its_first_nine_bytes():
    body = b"PK\x03\x04" + b"\0" * (8 << 20)  # a zip of 8 MiB, say
    f = CountingFile(body)
    with pytest.raises(PayloadError, match="bad magic"):
        index_update_file(f, len(body), MANIFEST)
    assert f.bytes_read == 9


@pytest.mark.parametrize("cut, message", [(-1, "trailing|needs"), (5, "update header"), (12, "length of tensor")])
def test_truncated_or_padded_framing_is_refused(cut, message):
    body = payload()
    broken = body + b"\0" if cut == -1 else body[:cut]
    with pytest.raises(PayloadError, match=message):
        index_update_file(io.BytesIO(broken), len(broken), MANIFEST)


def test_a_length_past_the_end_is_refused_before_reading_it():
    body = bytearray(payload())
    body[9:13] = (1 << 31).to_bytes(4, "little")  # first tensor claims 2 GiB
    f = CountingFile(bytes(body))
    with pytest.raises(PayloadError, match="needs 2147483648 bytes"):
        index_update_file(f, len(body), MANIFEST)
    assert f.bytes_read == 13
