"""none, fp16 and bf16: exactness where promised, sizes, range errors."""
import numpy as np
import pytest
import torch

from compression import CompressionError, make_codec


def test_none_round_trip_is_bit_exact(randn):
    x = randn(1000, scale=123.0)
    x[0] = -0.0
    codec = make_codec("none")
    payload = codec.encode(x)
    assert len(payload) == 4 * 1000
    assert payload[:4] == np.float32(x[0].item()).tobytes()  # raw little-endian fp32
    out = codec.decode(payload, 1000)
    assert out.dtype == torch.float32
    assert torch.equal(out.view(torch.int32), x.view(torch.int32))


def test_fp16_exact_on_representable_inputs(randn):
    x = randn(999, seed=3).half().float()  # every value is an fp16 value
    codec = make_codec("fp16")
    payload = codec.encode(x)
    assert len(payload) == 2 * 999
    assert torch.equal(codec.decode(payload, 999), x)


def test_fp16_refuses_values_out_of_range():
    with pytest.raises(CompressionError, match="fp16 range"):
        make_codec("fp16").encode(torch.tensor([1.0, 70000.0]))


def test_bf16_rounds_to_nearest_even():
    # 1 + 2**-8 is halfway between bf16 neighbours 1 and 1 + 2**-7: ties go to the even one (1).
    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -2.5, 3e38])
    out = make_codec("bf16").decode(make_codec("bf16").encode(x), 4)
    assert out.tolist() == [1.0, 1 + 2**-6, -2.5, pytest.approx(3e38, rel=2**-8)]


def test_bf16_relative_error_below_half_ulp(randn):
    x = randn(4096, seed=5)
    codec = make_codec("bf16")
    payload = codec.encode(x)
    assert len(payload) == 2 * 4096
    out = codec.decode(payload, 4096)
    assert torch.all((out - x).abs() <= x.abs() * 2**-8)
    assert torch.equal(out, x.to(torch.bfloat16).float())  # same rounding as torch


def test_encode_refuses_non_finite_input():
    with pytest.raises(CompressionError, match="non-finite|NaN"):
        make_codec("none").encode(torch.tensor([1.0, float("nan")]))


def test_encode_refuses_integer_tensor():
    with pytest.raises(CompressionError, match="floating point"):
        make_codec("none").encode(torch.arange(4))
