"""Blockwise absmax int8/int4: half-step error bound, exact byte counts, fp16 scales."""
import math

import numpy as np
import pytest
import torch

from compression import CompressionError, make_codec


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    padded = torch.zeros(math.ceil(x.numel() / block) * block)
    padded[: x.numel()] = x.abs()
    return padded.view(-1, block).amax(dim=1).repeat_interleave(block)[: x.numel()]


@pytest.mark.parametrize("spec, qmax", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("n, block", [(1000, 64), (4096, 64), (37, 16), (513, 128)])
def test_error_at_most_half_a_step(randn, spec, qmax, n, block):
    x = randn(n, seed=n) * torch.linspace(0.01, 10, n)  # blocks with very different ranges
    codec = make_codec(spec, {"block_size": block})
    out = codec.decode(codec.encode(x), n)
    half_step = block_absmax(x, block) / qmax / 2
    assert torch.all((out - x).abs() <= half_step * (1 + 1e-6))


@pytest.mark.parametrize(
    "spec, n, block, scale_dtype, expected",
    [
        ("int8", 1000, 64, "fp32", 1000 + 16 * 4),  # ceil(1000/64) = 16 scales
        ("int8", 1000, 64, "fp16", 1000 + 16 * 2),
        ("int8", 1000, 128, "fp32", 1000 + 8 * 4),
        ("int4", 1000, 64, "fp32", 500 + 16 * 4),  # two codes per byte
        ("int4", 1001, 64, "fp16", 501 + 16 * 2),
    ],
)
def test_payload_size_is_codes_plus_scales(randn, spec, n, block, scale_dtype, expected):
    codec = make_codec(spec, {"block_size": block, "scale_dtype": scale_dtype})
    assert len(codec.encode(randn(n))) == expected


def test_int8_layout_scales_then_codes():
    x = torch.tensor([1.27, -0.635, 0.0, 0.01])
    payload = make_codec("int8", {"block_size": 4}).encode(x)
    (scale,) = np.frombuffer(payload[:4], "<f4")
    assert scale == pytest.approx(0.01)
    assert np.frombuffer(payload[4:], "i1").tolist() == [127, -64, 0, 1]  # -63.5 -> -64 (ties to even)


def test_fp16_scale_rounds_up_so_codes_never_clip(randn):
    x = randn(640, seed=9, scale=3.3)
    codec = make_codec("int8", {"scale_dtype": "fp16"})
    payload = codec.encode(x)
    scales = torch.from_numpy(np.frombuffer(payload[: 10 * 2], "<f2").astype(np.float32))
    absmax = block_absmax(x, 64)[::64]
    assert torch.all(scales >= absmax / 127)
    out = codec.decode(payload, 640)
    assert torch.all((out - x).abs() <= scales.repeat_interleave(64) / 2 * (1 + 1e-6))


def test_fp16_scale_overflow_is_reported():
    with pytest.raises(CompressionError, match="scale_dtype='fp32'"):
        make_codec("int8", {"scale_dtype": "fp16"}).encode(torch.tensor([1e10]))


@pytest.mark.parametrize("spec, qmax", [("int8", 127), ("int4", 7)])
def test_zero_blocks_and_grid_values_are_exact(spec, qmax):
    grid = torch.arange(-qmax, qmax + 1, dtype=torch.float32) * 0.25  # multiples of the step 0.25
    x = torch.cat([torch.zeros(2 * qmax + 1), grid])
    codec = make_codec(spec, {"block_size": 2 * qmax + 1})
    assert torch.equal(codec.decode(codec.encode(x), x.numel()), x)


def test_stochastic_rounding_is_unbiased_within_one_step(randn):
    x = randn(256, seed=4)
    codec = make_codec("int4", {"stochastic": True, "block_size": 256})
    step = x.abs().max() / 7
    outs = torch.stack([codec.decode(codec.encode(x, seed=s), 256) for s in range(400)])
    assert torch.all((outs - x).abs() < step * (1 + 1e-6))
    # mean of 400 draws: standard error <= step / 2 / 20 per entry
    assert torch.all((outs.mean(0) - x).abs() < step * 0.15)
    assert not torch.equal(outs[0], outs[1])


def test_config_errors_quote_the_bad_value():
    with pytest.raises(CompressionError, match="block_size must be .* got 0"):
        make_codec("int8", {"block_size": 0})
    with pytest.raises(CompressionError, match="scale_dtype must be one of .* got 'bf16'"):
        make_codec("int4", {"scale_dtype": "bf16"})
