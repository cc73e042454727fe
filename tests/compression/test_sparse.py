"""Sparsifiers (topk, randomk, threshold), index codes and pipelines."""
import math

import numpy as np
import pytest
import torch

from compression import CompressionError, make_codec
from compression.buffers import Reader
from compression.index_coding import INDEX_CODINGS, varint_encode


@pytest.mark.parametrize("gaps, expected", [([0, 127, 128, 300], "007f8001ac02"), ([], "")])
def test_varint_matches_leb128_by_hand(gaps, expected):
    assert varint_encode(np.array(gaps, dtype=np.uint64)).hex() == expected


@pytest.mark.parametrize("coding", sorted(INDEX_CODINGS))
@pytest.mark.parametrize(
    "indices, numel",
    [([], 10), ([0], 1), ([9], 10), (list(range(50)), 50), ([3, 200, 201, 99_999], 100_000)],
)
def test_index_codes_round_trip_edge_cases(coding, indices, numel):
    code = INDEX_CODINGS[coding]
    indices = np.array(indices, dtype=np.int64)
    reader = Reader(code.encode(indices, numel))
    assert code.decode(reader, indices.size, numel).tolist() == indices.tolist()
    assert reader.remaining == 0


@pytest.mark.parametrize("coding", sorted(INDEX_CODINGS))
def test_index_codes_round_trip_random_sets(coding):
    rng = np.random.default_rng(0)
    code = INDEX_CODINGS[coding]
    for _ in range(50):
        numel = int(rng.integers(1, 50_000))
        indices = np.sort(rng.choice(numel, size=int(rng.integers(0, min(numel, 500) + 1)), replace=False))
        reader = Reader(code.encode(indices, numel))
        assert np.array_equal(code.decode(reader, indices.size, numel), indices)


def test_topk_keeps_largest_magnitudes_of_each_chunk(randn):
    x = randn(10_000, seed=1)
    codec = make_codec("topk", {"ratio": 0.01, "chunk_size": 4096})
    out = codec.decode(codec.encode(x), 10_000)
    kept = out.nonzero().flatten()
    # ceil(40.96) + ceil(40.96) + ceil(18.08) entries, chunk by chunk
    assert kept.numel() == 41 + 41 + 19
    for start, k in ((0, 41), (4096, 41), (8192, 19)):
        chunk = x[start : start + 4096]
        expected = chunk.abs().topk(k).indices + start
        assert sorted(expected.tolist()) == [i for i in kept.tolist() if start <= i < start + 4096]
    assert torch.equal(out[kept], x[kept])  # fp32 values are exact


@pytest.mark.parametrize("coding", sorted(INDEX_CODINGS))
def test_topk_index_bytes_far_below_four_per_index(randn, coding):
    x = randn(100_000, seed=2)
    codec = make_codec("topk", {"ratio": 0.01, "index_coding": coding})
    payload = codec.encode(x)
    stats = codec.inspect(payload, 100_000)
    k = stats.sent
    assert k == 24 * 41 + math.ceil(0.01 * (100_000 - 24 * 4096))
    assert len(payload) == stats.index_bytes + 4 * k
    assert stats.index_bytes < 1.5 * k  # vs 4 bytes for int32 indices


def test_rice_beats_varint_on_typical_gaps(randn):
    x = randn(100_000, seed=2)
    sizes = {c: make_codec("topk", {"index_coding": c}).inspect(
        make_codec("topk", {"index_coding": c}).encode(x), 100_000).index_bytes for c in INDEX_CODINGS}
    assert sizes["rice"] < sizes["varint"]


def test_randomk_sends_no_index_bytes(randn):
    x = randn(10_000, seed=3)
    codec = make_codec("randomk", {"ratio": 0.05})
    payload = codec.encode(x, seed=4)
    assert len(payload) == 8 + 4 * 500  # u64 selection seed + fp32 values
    assert codec.inspect(payload, 10_000).index_bytes == 0
    out = codec.decode(payload, 10_000)
    kept = out.nonzero().flatten()
    assert kept.numel() == 500
    assert torch.equal(out[kept], x[kept])
    other = codec.decode(codec.encode(x, seed=5), 10_000)
    assert not torch.equal(other.nonzero(), out.nonzero())


def test_threshold_sends_exactly_the_large_entries(randn):
    x = randn(5000, seed=6)
    codec = make_codec("threshold", {"threshold": 2.0})
    payload = codec.encode(x)
    out = codec.decode(payload, 5000)
    large = x.abs() >= 2.0
    assert torch.equal(out, torch.where(large, x, torch.zeros(())))
    stats = codec.inspect(payload, 5000)
    assert stats.sent == int(large.sum())
    assert len(payload) == stats.index_bytes + 4 * stats.sent
    assert int.from_bytes(payload[:4], "little") == stats.sent


def test_topk_int8_pipeline_composes_support_and_quantizer(randn):
    x = randn(10_000, seed=7)
    pipeline = make_codec("topk+int8", {"topk": {"ratio": 0.02}, "int8": {"block_size": 32}})
    assert pipeline.spec == "topk+int8"
    payload = pipeline.encode(x)
    topk_only = make_codec("topk", {"ratio": 0.02})
    support = topk_only.decode(topk_only.encode(x), 10_000).nonzero().flatten()
    out = pipeline.decode(payload, 10_000)
    assert torch.equal(out.nonzero().flatten(), support)
    k = support.numel()
    stats = pipeline.inspect(payload, 10_000)
    assert len(payload) == stats.index_bytes + k + math.ceil(k / 32) * 4
    step = x[support].abs().max() / 127
    assert torch.all((out[support] - x[support]).abs() <= step / 2 * (1 + 1e-6))


@pytest.mark.parametrize("spec, value_bytes", [("topk+int4", 0.5), ("randomk+fp16", 2), ("threshold+bf16", 2)])
def test_pipelines_shrink_value_bytes(randn, spec, value_bytes):
    x = randn(8192, seed=8)
    pipeline = make_codec(spec, {spec.split("+")[0]: {"threshold": 1.5} if spec.startswith("threshold") else {}})
    payload = pipeline.encode(x, seed=1)
    stats = pipeline.inspect(payload, 8192)
    support_bytes = 8 if spec.startswith("randomk") else stats.index_bytes
    scale_bytes = 4 * math.ceil(stats.sent / 64) if spec.endswith("int4") else 0
    assert len(payload) == support_bytes + math.ceil(stats.sent * value_bytes) + scale_bytes
    out = pipeline.decode(payload, 8192)
    assert (out != 0).sum() <= stats.sent


@pytest.mark.parametrize("spec", ["int8+topk", "topk+randomk", "topk+powersgd", "topk+int8+fp16"])
def test_invalid_pipelines_are_rejected(spec):
    with pytest.raises(CompressionError, match="pipeline"):
        make_codec(spec)
