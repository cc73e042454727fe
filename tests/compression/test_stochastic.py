"""qsgd, natural, terngrad (unbiased, seeded) and signsgd: grids, sizes, unbiasedness."""
import math

import numpy as np
import pytest
import torch

from compression import make_codec

DRAWS = 300


def draws(codec, x, count=DRAWS):
    return torch.stack([codec.decode(codec.encode(x, seed=s), x.numel()) for s in range(count)]).double()


def assert_unbiased(samples: torch.Tensor, x: torch.Tensor) -> None:
    """The sample mean sits within sampling noise of ``x``.

    E||mean - x||^2 = trace(cov) / N for an unbiased codec; a bias b adds ||b||^2,
    which does not shrink with N. Allow twice the expected noise.
    """
    n = samples.shape[0]
    err = ((samples.mean(0) - x.double()) ** 2).sum()
    noise = samples.var(0).sum() / n
    assert err <= 2 * noise + 1e-12, (float(err), float(noise))


@pytest.mark.parametrize(
    "spec, config",
    [
        ("qsgd", {"levels": 4, "bucket_size": 128}),
        ("qsgd", {"levels": 1}),
        ("natural", {}),
        ("natural", {"bits": 3}),
        ("terngrad", {}),
        ("int8", {"stochastic": True}),
    ],
)
@pytest.mark.slow
def test_stochastic_codecs_are_unbiased(randn, spec, config):
    x = randn(512, seed=11) * torch.linspace(0.1, 2.0, 512)
    assert_unbiased(draws(make_codec(spec, config), x), x)


def test_unbiasedness_check_catches_biased_codecs(randn):
    x = randn(512, seed=11) * torch.linspace(0.1, 2.0, 512)
    for biased in (make_codec("signsgd"), make_codec("randomk", {"ratio": 0.5})):  # randomk without rescale
        with pytest.raises(AssertionError):
            assert_unbiased(draws(biased, x, count=50), x)


def test_randomk_with_rescale_is_unbiased(randn):
    x = randn(512, seed=11)
    assert_unbiased(draws(make_codec("randomk", {"ratio": 0.25, "rescale": True}), x), x)


@pytest.mark.parametrize("spec", ["qsgd", "natural", "terngrad", "randomk"])
def test_same_seed_same_bytes_other_seed_other_bytes(randn, spec):
    codec, x = make_codec(spec), randn(2000, seed=2)
    assert codec.encode(x, seed=7) == codec.encode(x, seed=7)
    assert codec.encode(x, seed=7) != codec.encode(x, seed=8)
    other_config = make_codec(spec, {"seed": 1})
    assert other_config.encode(x, seed=7) != codec.encode(x, seed=7)


def test_qsgd_size_and_grid(randn):
    x = randn(1000, seed=1)
    codec = make_codec("qsgd", {"levels": 16, "bucket_size": 512})
    payload = codec.encode(x)
    # 2 bucket norms (fp32) + 1000 codes of bit_length(32) = 6 bits
    assert len(payload) == 2 * 4 + math.ceil(1000 * 6 / 8)
    norms = torch.from_numpy(np.frombuffer(payload[:8], "<f4").copy()).repeat_interleave(512)[:1000]
    levels = codec.decode(payload, 1000) / norms * 16
    assert torch.allclose(levels, levels.round(), atol=1e-4)
    assert torch.all(levels.abs() <= 16)
    assert torch.all((levels.round() == 0) | (torch.sign(levels) == torch.sign(x)))


def test_natural_rounds_to_neighbouring_powers_of_two(randn):
    x = randn(1000, seed=3)
    codec = make_codec("natural")
    payload = codec.encode(x)
    assert len(payload) == 2 + 1000  # int16 max exponent + one byte per value
    out = codec.decode(payload, 1000)
    low = torch.exp2(torch.floor(torch.log2(x.abs())))
    assert torch.all((out.abs() == low) | (out.abs() == 2 * low))
    assert torch.all(torch.sign(out) == torch.sign(x))


def test_natural_fewer_bits_and_tiny_values():
    x = torch.tensor([1.0, -0.75, 2.0**-20, 0.0, 3.0])
    codec = make_codec("natural", {"bits": 3})  # 3 powers: 4, 2, 1
    payload = codec.encode(x)
    assert len(payload) == 2 + math.ceil(5 * 3 / 8)
    out = codec.decode(payload, 5)
    assert out[0] == 1.0 and out[1] in (-0.5, -1.0) and out[3] == 0.0 and out[4] in (2.0, 4.0)
    assert out[2] in (0.0, 1.0)  # below the smallest power: 0 or the smallest power, unbiased


def test_terngrad_values_and_size(randn):
    x = randn(1000, seed=4)
    codec = make_codec("terngrad")
    payload = codec.encode(x)
    assert len(payload) == 4 + math.ceil(1000 / 4)
    out = codec.decode(payload, 1000)
    scale = x.abs().max()
    assert set(out.unique().tolist()) <= {-scale.item(), 0.0, scale.item()}
    assert out[x.abs().argmax()] == x[x.abs().argmax()]  # the max entry fires with probability 1


def test_signsgd_size_and_values(randn):
    x = randn(1000, seed=5)
    codec = make_codec("signsgd")
    payload = codec.encode(x)
    assert len(payload) == math.ceil(1000 / 8) + 4
    out = codec.decode(payload, 1000)
    scale = x.abs().mean()
    assert torch.allclose(out, torch.where(x >= 0, scale, -scale))
    assert payload[4:] == np.packbits((x >= 0).numpy(), bitorder="little").tobytes()
