"""A 1M-value tensor must encode and decode in milliseconds, not seconds.

The bound is loose (shared CI machines) but a per-element Python loop
would miss it by two orders of magnitude.
"""
import time

import pytest
import torch

from compression import CODECS, make_codec

SHAPE = (1024, 1024)
BUDGET_S = 0.5


@pytest.fixture(scope="module")
def big():
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)) * 0.01


@pytest.mark.parametrize("spec", sorted(CODECS) + ["topk+int8", "randomk+fp16"])
def test_one_million_values_round_trip_quickly(big, spec):
    codec = make_codec(spec, {"threshold": 0.02} if spec == "threshold" else None)
    start = time.perf_counter()
    payload = codec.encode(big, seed=1, shape=SHAPE)
    out = codec.decode(payload, big.numel(), shape=SHAPE)
    elapsed = time.perf_counter() - start
    assert out.shape == (big.numel(),)
    assert elapsed < BUDGET_S, f"{spec} took {elapsed * 1000:.0f} ms for 1M values"
