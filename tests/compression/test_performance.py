"""A 1M-value tensor must be encoded and decoded by tensor operations, not a per-element loop.

Counted, not timed: a profiler hook counts the Python-level calls (Python functions and builtins,
torch ops included) one round trip makes. Tensor code makes a few hundred whatever the size; a
per-element Python loop makes at least one per element, so a million. Speed itself is measured
in bench/compression.py, as ratios within one run.
"""
import sys

import pytest
import torch

from compression import CODECS, make_codec

SHAPE = (1024, 1024)
MAX_CALLS = 20_000
"""Far above what the codecs make (measured: at most a few thousand), far below one per value."""


@pytest.fixture(scope="module")
def big():
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)) * 0.01


def count_calls(run) -> int:
    calls = 0

    def hook(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("spec", sorted(CODECS) + ["topk+int8", "randomk+fp16"])
def test_one_million_values_round_trip_without_a_python_loop(big, spec):
    codec = make_codec(spec, {"threshold": 0.02} if spec == "threshold" else None)
    out = []
    calls = count_calls(lambda: out.append(codec.decode(codec.encode(big, seed=1, shape=SHAPE), big.numel(),
                                                        shape=SHAPE)))
    assert out[0].shape == (big.numel(),)
    assert calls < MAX_CALLS, f"{spec} made {calls} Python calls for 1M values"


def test_the_count_would_catch_a_per_element_loop():
    values = torch.arange(100_000, dtype=torch.float32)
    assert count_calls(lambda: [values[i].item() for i in range(values.numel())]) >= 100_000
    assert count_calls(lambda: [round(v * 0.5) for v in values.tolist()]) >= 100_000
