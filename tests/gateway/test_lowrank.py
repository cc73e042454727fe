import math

import pytest
import torch

from gateway.lora import LoraModule
from gateway.lowrank import concatenate, factorise, sketch_factorise, truncate


def svd_tail_error(dense: torch.Tensor, rank: int) -> float:
    """Eckart-Young: relative Frobenius error of the best rank-k approximation."""
    s = torch.linalg.svdvals(dense.double())
    return math.sqrt((s[rank:] ** 2).sum() / (s**2).sum())


def random_module(out_features, in_features, rank, scale, seed) -> LoraModule:
    g = torch.Generator().manual_seed(seed)
    return LoraModule(
        A=torch.randn(rank, in_features, generator=g),
        B=torch.randn(out_features, rank, generator=g),
        scale=scale,
    )


def test_concatenate_is_the_exact_weighted_sum():
    ranks_and_scales = [(3, 2.0), (1, 0.5), (2, 1.0)]
    modules = [random_module(9, 7, r, s, seed) for seed, (r, s) in enumerate(ranks_and_scales)]
    cat = concatenate(modules, [0.2, -1.0, 0.7])
    assert cat.rank == 6 and cat.scale == 1.0
    expected = sum(c * m.delta() for c, m in zip([0.2, -1.0, 0.7], modules))
    torch.testing.assert_close(cat.delta(), expected)


def test_concatenate_leaves_out_zero_coefficients():
    modules = [random_module(9, 7, 3, 2.0, 0), random_module(9, 7, 4, 1.0, 1)]
    assert concatenate(modules, [0.0, 1.0]).rank == 4
    assert concatenate(modules, [0.0, 0.0]).delta().abs().max() == 0


@pytest.mark.parametrize("shape", [(30, 12), (12, 30)])
def test_truncate_matches_svd_of_the_dense_update(shape):
    module = concatenate([random_module(*shape, 4, 1.5, s) for s in range(3)], [0.5, 0.3, 0.2])
    dense = module.delta()
    for rank in (12, 5, 1):
        cut = truncate(module, rank)
        assert cut.module.rank == min(rank, 12)
        expected = svd_tail_error(dense, rank)
        assert cut.relative_error == pytest.approx(expected, abs=1e-6)
        measured = torch.linalg.norm(dense - cut.module.delta()) / torch.linalg.norm(dense)
        assert measured.item() == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("shape", [(40, 15), (15, 40), (16, 16)])
def test_factorise_matches_svd_of_the_dense_update(shape):
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(*shape, generator=g) * torch.logspace(0, -2, shape[1])  # decaying spectrum
    full = factorise(dense, 100)
    torch.testing.assert_close(full.module.delta(), dense, rtol=1e-5, atol=1e-5)
    assert full.relative_error < 1e-5
    for rank in (6, 1):
        cut = factorise(dense, rank)
        assert cut.module.rank == rank
        assert cut.relative_error == pytest.approx(svd_tail_error(dense, rank), abs=1e-5)


def test_factorise_of_zero_is_zero():
    cut = factorise(torch.zeros(5, 4), 2)
    assert cut.relative_error == 0.0 and cut.norm == 0.0
    assert not cut.module.delta().any()


def test_sketched_factors_are_near_best_on_a_merged_update():
    """A TIES-like update (trimmed low-rank pieces, so full rank with a dominant part): the sketch
    seeded with the experts' A rows loses no more than the truncated SVD, to 1e-4."""
    from gateway.merges.ties import elect_and_merge, trim

    modules = [random_module(120, 80, 4, 1.0, seed) for seed in range(3)]
    dense = elect_and_merge(torch.stack([trim(m.delta(), 0.3) for m in modules]))
    start = torch.cat([m.A for m in modules]).T
    for rank in (12, 5):
        cut = sketch_factorise(dense, rank, start)
        assert cut.module.rank == rank
        assert cut.relative_error == pytest.approx(svd_tail_error(dense, rank), abs=1e-4)
        measured = torch.linalg.norm(dense - cut.module.delta()) / torch.linalg.norm(dense)
        assert cut.relative_error == pytest.approx(measured.item(), abs=1e-6)
    again = sketch_factorise(dense, 12, start)  # a fixed seed: the same factors every time
    assert torch.equal(again.module.A, sketch_factorise(dense, 12, start).module.A)


def test_factored_error_equals_the_dense_difference_for_any_factors():
    """||delta - B A|| from k-column products only; B and A here are arbitrary, not a projection."""
    from gateway.lowrank import factored_error

    g = torch.Generator().manual_seed(3)
    for out_features, in_features, k in ((300, 120, 7), (90, 260, 12)):
        delta = torch.randn(out_features, in_features, generator=g) @ torch.diag(torch.logspace(0, -1, in_features))
        B = torch.randn(out_features, k, generator=g)
        A = torch.randn(k, in_features, generator=g) * 0.1
        direct = torch.linalg.norm(delta - B @ A).item()
        norm = torch.linalg.norm(delta).item()
        assert factored_error(norm, delta @ A.T, B, A) == pytest.approx(direct, rel=1e-5)


def test_sketch_error_is_measured_directly_when_nearly_exact():
    """A rank-5 update cut to rank 5: the subtraction formula would be all cancellation, so the
    reported error is the dense difference's, ~1e-7 of the norm rather than ~1e-3."""
    module = random_module(200, 100, 5, 1.0, seed=4)
    dense = module.delta()
    cut = sketch_factorise(dense, 5, module.A.T)
    measured = (torch.linalg.norm(dense - cut.module.delta()) / torch.linalg.norm(dense)).item()
    assert cut.relative_error < 1e-5
    assert cut.relative_error == pytest.approx(measured, abs=1e-7)
