"""Hostile bytes: decoding may succeed or raise PayloadError, never anything else."""
import struct

import numpy as np
import pytest
import torch

from compression import CODECS, PayloadError, decode_update, encode_update, make_codec
from compression.wire import split_update

MANIFEST = [("w", (8, 50)), ("v", (30,)), ("empty", (0,)), ("one", (1, 1))]
FUZZ_SPECS = [(name, None) for name in sorted(CODECS)] + [
    ("topk+int8", None),
    ("topk+int4", {"topk": {"ratio": 0.2, "index_coding": "varint"}}),
    ("randomk+fp16", {"randomk": {"ratio": 0.3}}),
    ("threshold+natural", {"threshold": {"threshold": 0.5}}),
    ("threshold", {"threshold": 0.5, "index_coding": "varint"}),
    ("int8", {"scale_dtype": "fp16", "block_size": 7}),
    ("natural", {"bits": 3}),
    ("qsgd", {"levels": 3, "bucket_size": 16}),
    ("topk", {"ratio": 0.5, "chunk_size": 16}),
]
CASES_PER_KIND = 40


def valid_payload(codec, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(shape, generator=gen) for name, shape in MANIFEST}
    return encode_update(tensors, MANIFEST, codec, seed=seed)


def decode_or_payload_error(payload, codec):
    """The only acceptable outcomes: a well-formed update or a PayloadError."""
    try:
        out = decode_update(payload, MANIFEST, codec)
    except PayloadError:
        return False
    assert [tuple(out[name].shape) for name, _ in MANIFEST] == [shape for _, shape in MANIFEST]
    assert all(torch.isfinite(t).all() and t.dtype == torch.float32 for t in out.values())
    return True


def framed(bodies):
    head = struct.pack("<4sBI", b"FMC1", 1, len(bodies))
    return head + b"".join(struct.pack("<I", len(b)) + b for b in bodies)


def body_sizes(payload):
    sizes, pos = [], 9
    for _ in MANIFEST:
        (size,) = struct.unpack_from("<I", payload, pos)
        sizes.append(size)
        pos += 4 + size
    return sizes


@pytest.fixture(params=FUZZ_SPECS, ids=lambda p: p[0] + ("*" if p[1] else ""))
def codec(request):
    return make_codec(*request.param)


def test_valid_payload_decodes(codec):
    assert decode_or_payload_error(valid_payload(codec), codec)


def test_random_bytes(codec):
    rng = np.random.default_rng(1)
    for _ in range(CASES_PER_KIND):
        assert not decode_or_payload_error(rng.bytes(int(rng.integers(0, 600))), codec)


def test_random_bodies_in_a_valid_frame(codec):
    rng = np.random.default_rng(2)
    sizes = body_sizes(valid_payload(codec))
    for case in range(CASES_PER_KIND):
        # half the time the exact expected sizes, so the bytes reach the codec's own checks
        lengths = sizes if case % 2 else [max(0, s + int(rng.integers(-3, 4))) for s in sizes]
        decode_or_payload_error(framed([rng.bytes(n) for n in lengths]), codec)


def test_truncated_and_padded(codec):
    payload = valid_payload(codec, seed=3)
    rng = np.random.default_rng(3)
    cuts = set(range(min(len(payload), 20))) | set(rng.integers(0, len(payload), CASES_PER_KIND).tolist())
    for cut in sorted(cuts):
        assert not decode_or_payload_error(payload[:cut], codec)
    for pad in (b"\0", b"\xff" * 3, rng.bytes(17)):
        assert not decode_or_payload_error(payload + pad, codec)


def test_lying_lengths(codec):
    payload = bytearray(valid_payload(codec, seed=4))
    pos = 9
    for size in body_sizes(bytes(payload)):
        for lie in (size + 1, max(size - 1, 0) if size else 1, 2**32 - 1, size * 2 + 5):
            if lie != size:
                forged = payload[:pos] + struct.pack("<I", lie) + payload[pos + 4 :]
                assert not decode_or_payload_error(bytes(forged), codec)
        pos += 4 + size


def test_bit_flips(codec):
    payload = valid_payload(codec, seed=5)
    rng = np.random.default_rng(5)
    for _ in range(CASES_PER_KIND):
        flipped = bytearray(payload)
        for pos in rng.integers(0, len(payload), int(rng.integers(1, 4))):
            flipped[pos] ^= 1 << int(rng.integers(0, 8))
        decode_or_payload_error(bytes(flipped), codec)  # may still be valid; must not crash


@pytest.mark.slow
def test_mutated_bodies_with_consistent_lengths(codec):
    """Overwrite, delete or insert bytes inside a body and fix up its length, so the
    frame is valid and the mutation reaches the codec's own parsing."""
    rng = np.random.default_rng(6)
    for case in range(3 * CASES_PER_KIND):
        bodies = [bytearray(b) for b in split_update(valid_payload(codec, seed=case % 4), MANIFEST)]
        body = bodies[int(rng.integers(0, 2))]
        where = int(rng.integers(0, len(body) + 1))
        if case % 3 == 0 and body:
            body[min(where, len(body) - 1)] = int(rng.integers(0, 256))
        elif case % 3 == 1 and body:
            del body[min(where, len(body) - 1)]
        else:
            body.insert(where, int(rng.integers(0, 256)))
        decode_or_payload_error(framed([bytes(b) for b in bodies]), codec)


@pytest.mark.parametrize("numel", [0, 1, 5, 64, 300])
def test_codec_level_random_bytes(codec, numel):
    rng = np.random.default_rng(numel)
    expected = len(codec.encode(torch.ones(numel)))
    for _ in range(CASES_PER_KIND // 2):
        body = rng.bytes(max(0, expected + int(rng.integers(-2, 3))))
        try:
            out = codec.decode(body, numel)
        except PayloadError:
            continue
        assert out.shape == (numel,) and torch.isfinite(out).all()
