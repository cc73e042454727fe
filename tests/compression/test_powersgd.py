"""PowerSGD: exact on low-rank input, factor sizes, dense fallback, shape agreement."""
import pytest
import torch

from compression import PayloadError, make_codec


def low_rank(n, m, rank, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, rank, generator=gen) @ torch.randn(rank, m, generator=gen)


def test_recovers_a_matrix_of_rank_at_most_r():
    m = low_rank(64, 96, rank=2)
    codec = make_codec("powersgd", {"rank": 2})
    payload = codec.encode(m, shape=(64, 96))
    assert len(payload) == 4 * 2 * (64 + 96)  # P (64x2) and Q (96x2), fp32
    out = codec.decode(payload, m.numel(), shape=(64, 96)).view(64, 96)
    assert torch.allclose(out, m, atol=1e-4 * m.abs().max())


def test_rank_r_error_is_near_the_best_rank_r_error():
    gen = torch.Generator().manual_seed(1)
    m = low_rank(128, 128, rank=4, seed=1) + 0.01 * torch.randn(128, 128, generator=gen)
    out = make_codec("powersgd", {"rank": 4}).decode(
        make_codec("powersgd", {"rank": 4}).encode(m, shape=(128, 128)), m.numel(), shape=(128, 128)
    ).view(128, 128)
    s = torch.linalg.svdvals(m)
    best = s[4:].square().sum().sqrt()
    # one power iteration from a random start is not optimal, but stays within a small factor
    assert torch.linalg.norm(m - out) < 3 * best < 0.05 * torch.linalg.norm(m)


def test_lora_shapes_use_factors(lora_update, lora_manifest):
    codec = make_codec("powersgd", {"rank": 2})
    for name, shape in lora_manifest:
        assert len(codec.encode(lora_update[name], shape=shape)) == 4 * 2 * (8 + 896)


@pytest.mark.parametrize("shape", [(100,), (4, 4), (3, 1000)])
def test_dense_fallback_when_factors_are_not_smaller(shape):
    x = torch.randn(shape)
    codec = make_codec("powersgd", {"rank": 4})
    payload = codec.encode(x, shape=shape)
    assert len(payload) == 4 * x.numel()
    assert torch.equal(codec.decode(payload, x.numel(), shape=shape), x.reshape(-1))


def test_higher_dim_tensors_are_viewed_as_first_dim_by_rest():
    x = low_rank(16, 60, rank=1).reshape(16, 6, 10)
    codec = make_codec("powersgd", {"rank": 1})
    payload = codec.encode(x, shape=(16, 6, 10))
    assert len(payload) == 4 * (16 + 60)
    assert torch.allclose(codec.decode(payload, 960, shape=(16, 6, 10)), x.reshape(-1), atol=1e-4)


def test_decoding_without_the_encoding_shape_fails_cleanly():
    codec = make_codec("powersgd", {"rank": 2})
    payload = codec.encode(low_rank(64, 96, 2), shape=(64, 96))
    with pytest.raises(PayloadError):
        codec.decode(payload, 64 * 96)
