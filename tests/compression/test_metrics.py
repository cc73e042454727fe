"""measure(): hand-computed byte accounting and distortion."""
import math

import pytest
import torch

from compression import encode_update, decode_update, make_codec, measure


def test_hand_computed_values():
    original = {"w": torch.tensor([3.0, 4.0])}
    decoded = {"w": torch.tensor([3.0, 0.0])}
    m = measure(original, decoded, b"x" * 10, encode_ms=1.5, decode_ms=0.5)
    assert m["bytes_raw"] == 8 and m["bytes_sent"] == 10
    assert m["ratio"] == pytest.approx(0.8)
    assert m["bits_per_param"] == pytest.approx(40.0)
    assert m["relative_error"] == pytest.approx(4 / 5)
    assert m["cosine"] == pytest.approx(3 / 5)
    assert m["density"] == pytest.approx(0.5)  # no codec given: non-zero decoded fraction
    assert m["index_bytes"] is None and m["encode_ms"] == 1.5


def test_sparsifier_accounting_from_the_payload(lora_update, lora_manifest):
    codec = make_codec("topk+int8", {"topk": {"ratio": 0.01}})
    payload = encode_update(lora_update, lora_manifest, codec)
    decoded = decode_update(payload, lora_manifest, codec)
    m = measure(lora_update, decoded, payload, 0.0, 0.0, codec=codec, manifest=lora_manifest)
    k = 2 * (math.ceil(0.01 * 4096) + math.ceil(0.01 * 3072))  # two chunks per 7168-value tensor
    assert m["density"] == pytest.approx(k / 14336)
    assert m["framing_bytes"] == 9 + 2 * 4
    value_bytes = 2 * (72 + 2 * 4)  # 72 int8 codes and two block scales per tensor
    assert m["bytes_sent"] == m["framing_bytes"] + m["index_bytes"] + value_bytes
    assert 0 < m["index_bytes"] < k * 1.5
    assert m["bytes_raw"] == 4 * 14336 and m["ratio"] == pytest.approx(4 * 14336 / len(payload))


def test_dense_codec_has_full_density_and_no_index_bytes(lora_update, lora_manifest):
    codec = make_codec("int8")
    payload = encode_update(lora_update, lora_manifest, codec)
    decoded = decode_update(payload, lora_manifest, codec)
    m = measure(lora_update, decoded, payload, 0.0, 0.0, codec=codec, manifest=lora_manifest)
    assert m["density"] == 1.0 and m["index_bytes"] == 0
    assert m["relative_error"] < 0.01 and m["cosine"] > 0.9999


def test_zero_update_edge_cases():
    zeros = {"w": torch.zeros(4)}
    m = measure(zeros, zeros, b"", 0.0, 0.0)
    assert m["relative_error"] == 0.0 and m["cosine"] == 1.0 and m["ratio"] == math.inf
    m = measure(zeros, {"w": torch.ones(4)}, b"1", 0.0, 0.0)
    assert m["relative_error"] == math.inf and m["cosine"] == 0.0
