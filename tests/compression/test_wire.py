"""Update framing: exact layout, manifest checks and strict decoding."""
import struct

import numpy as np
import pytest
import torch

from compression import CompressionError, PayloadError, decode_update, encode_update, make_codec
from compression.base import derive_seed
from compression.wire import MAGIC, split_update


def frame(*bodies: bytes, count=None, magic=MAGIC, version=1) -> bytes:
    head = struct.pack("<4sBI", magic, version, len(bodies) if count is None else count)
    return head + b"".join(struct.pack("<I", len(b)) + b for b in bodies)


def test_layout_is_header_then_length_prefixed_payloads(lora_update, lora_manifest):
    codec = make_codec("int8")
    payload = encode_update(lora_update, lora_manifest, codec)
    assert payload[:4] == b"FMC1" and payload[4] == 1
    assert struct.unpack_from("<I", payload, 5) == (2,)
    body = 7168 + 112 * 4  # 7168 int8 codes + ceil(7168/64) fp32 scales
    assert struct.unpack_from("<I", payload, 9) == (body,)
    assert len(payload) == 9 + 2 * (4 + body)
    bodies = [codec.encode(lora_update[n], seed=derive_seed(0, i), shape=sh) for i, (n, sh) in enumerate(lora_manifest)]
    assert payload == frame(*bodies)


@pytest.mark.parametrize("spec", ["none", "topk+int8", "powersgd", "randomk"])
def test_round_trip_restores_names_and_shapes(lora_update, lora_manifest, spec):
    codec = make_codec(spec)
    out = decode_update(encode_update(lora_update, lora_manifest, codec, seed=5), lora_manifest, codec)
    assert list(out) == [name for name, _ in lora_manifest]
    assert all(out[name].shape == shape for name, shape in lora_manifest)
    if spec == "none":
        assert all(torch.equal(out[n], lora_update[n]) for n in out)


def test_tensors_must_match_the_manifest(lora_update, lora_manifest):
    codec = make_codec("fp16")
    with pytest.raises(CompressionError, match="missing \\['extra'\\]"):
        encode_update(lora_update, lora_manifest + [("extra", (3,))], codec)
    with pytest.raises(CompressionError, match="unexpected \\['stray'\\]"):
        encode_update({**lora_update, "stray": torch.zeros(1)}, lora_manifest, codec)
    with pytest.raises(CompressionError, match="shape"):
        encode_update(lora_update, [(lora_manifest[0][0], (896, 8)), lora_manifest[1]], codec)
    with pytest.raises(CompressionError, match="unique"):
        encode_update(lora_update, lora_manifest + lora_manifest, codec)


def test_per_tensor_seeds_differ(lora_manifest):
    same = torch.ones(8, 896)
    tensors = {lora_manifest[0][0]: same, "b": same.clone()}
    manifest = [lora_manifest[0], ("b", (8, 896))]
    body_a, body_b = split_update(encode_update(tensors, manifest, make_codec("randomk")), manifest)
    assert bytes(body_a[:8]) != bytes(body_b[:8])  # the randomk selection seeds


MANIFEST = [("a", (10,)), ("b", (4,))]
GOOD_BODIES = (np.arange(10, dtype="<f4").tobytes(), np.ones(4, "<f4").tobytes())


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"", "update header: needs 9 bytes"),
        (frame(*GOOD_BODIES, magic=b"FMC0"), "bad magic"),
        (frame(*GOOD_BODIES, version=2), "unsupported format version 2"),
        (frame(*GOOD_BODIES, count=3), "holds 3 tensors, manifest lists 2"),
        (frame(GOOD_BODIES[0]), "holds 1 tensors"),
        (frame(*GOOD_BODIES) + b"\0", "1 unexpected trailing bytes"),
        (frame(*GOOD_BODIES)[:-1], "payload of tensor 'b': needs 16 bytes but only 15 remain"),
        (frame(GOOD_BODIES[0], GOOD_BODIES[1] + b"\0"), "tensor 'b': none: 1 unexpected trailing bytes"),
        (frame(GOOD_BODIES[0][:-4], GOOD_BODIES[1]), "tensor 'a': fp32 values: needs 40 bytes"),
        (frame(*GOOD_BODIES)[:9] + struct.pack("<I", 2**32 - 1), "needs 4294967295 bytes"),
        (frame(GOOD_BODIES[0], np.array([1, np.inf, 0, 0], "<f4").tobytes()), "NaN or infinity"),
    ],
)
def test_malformed_updates_raise_payload_error(payload, message):
    with pytest.raises(PayloadError, match=message):
        decode_update(payload, MANIFEST, make_codec("none"))


def test_round_trip_of_the_hand_built_frame():
    out = decode_update(frame(*GOOD_BODIES), MANIFEST, make_codec("none"))
    assert out["a"].tolist() == list(range(10)) and out["b"].tolist() == [1.0] * 4


def test_codec_config_mismatch_is_a_payload_error(lora_update, lora_manifest):
    payload = encode_update(lora_update, lora_manifest, make_codec("int8", {"block_size": 64}))
    with pytest.raises(PayloadError, match="tensor 'layers.0.lora_A'"):
        decode_update(payload, lora_manifest, make_codec("int8", {"block_size": 32}))
    payload = encode_update(lora_update, lora_manifest, make_codec("topk", {"ratio": 0.01}))
    with pytest.raises(PayloadError):
        decode_update(payload, lora_manifest, make_codec("topk", {"ratio": 0.02}))


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value >= 0x80 else 0))
        value >>= 7
        if not value:
            return bytes(out)


@pytest.mark.parametrize(
    "body, message",
    [
        (struct.pack("<I", 1) + varint(1000) + b"\0" * 4, "out of range for 1000 values"),
        (struct.pack("<I", 2) + varint(500) + varint(499) + b"\0" * 8, "index 1000 is out of range"),
        (struct.pack("<I", 1001), "threshold count 1001 exceeds 1000 values"),
        (struct.pack("<I", 2**32 - 1), "exceeds 1000 values"),  # no allocation from this count
        (struct.pack("<I", 1) + b"\x80\x00" + b"\0" * 4, "non-canonical"),  # 0 written in two bytes
        (struct.pack("<I", 2) + b"\x81\x80\x01\x00" + b"\0" * 8, "longer than 2 bytes"),
        (struct.pack("<I", 2) + varint(1), "found 1 of 2 values"),
        (struct.pack("<I", 1) + varint(3) + b"\0" * 3, "fp32 values: needs 4 bytes"),
    ],
)
def test_hostile_threshold_varint_payloads(body, message):
    codec = make_codec("threshold", {"index_coding": "varint"})
    assert codec.decode(struct.pack("<I", 1) + varint(3) + b"\0\0\x80\x3f", 1000)[3] == 1.0  # well-formed
    with pytest.raises(PayloadError, match=message):
        codec.decode(body, 1000)


def test_rice_unary_length_is_bounded_by_the_manifest():
    codec = make_codec("threshold", {"index_coding": "rice"})
    huge = struct.pack("<I", 1) + struct.pack("<BI", 0, 2**31)  # claims a 2 GiB unary part
    with pytest.raises(PayloadError, match="exceeds the bound"):
        codec.decode(huge, 10)


def test_non_finite_scale_is_rejected():
    body = np.array([np.nan], "<f4").tobytes() + b"\x01" * 10
    with pytest.raises(PayloadError, match="scales must be finite"):
        make_codec("int8", {"block_size": 64}).decode(body, 10)
