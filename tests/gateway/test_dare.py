import pytest
import torch

from gateway.merges import merge
from gateway.merges.dare import drop_and_rescale, mask_generator


def test_drop_keeps_entries_whole_rescaled_or_zero():
    delta = torch.randn(200, 100, generator=torch.Generator().manual_seed(0))
    dropped = drop_and_rescale(delta, 0.75, mask_generator(0, 0, "m"))
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept], delta[kept] * 4.0)
    assert kept.float().mean().item() == pytest.approx(0.25, abs=0.01)


def test_drop_is_unbiased():
    delta = torch.randn(30, 20, generator=torch.Generator().manual_seed(0))
    trials = 4000
    draws = (drop_and_rescale(delta, 0.5, mask_generator(s, 0, "m")) for s in range(trials))
    mean = sum(draws) / trials
    # one draw has relative error sqrt(p / (1 - p)) = 1; the mean of n has 1 / sqrt(n) ~ 0.016
    assert (torch.linalg.norm(mean - delta) / torch.linalg.norm(delta)).item() < 0.05


def test_dare_is_deterministic_for_a_seed_and_varies_with_it(experts):
    first = merge("dare", experts, [0.5, 0.3, 0.2], p=0.7, seed=11)
    again = merge("dare", experts, [0.5, 0.3, 0.2], p=0.7, seed=11)
    other = merge("dare", experts, [0.5, 0.3, 0.2], p=0.7, seed=12)
    for name in experts[0]:
        assert torch.equal(first.modules[name].delta(), again.modules[name].delta())
        assert not torch.equal(first.modules[name].delta(), other.modules[name].delta())
    assert first.config == {"p": 0.7, "seed": 11, "lam": 1.0, "rank": None}


def test_dare_is_lambda_times_the_sum_of_seeded_unbiased_drops(experts, helpers):
    # drop_and_rescale is unbiased (above), so by linearity the merge equals lam * sum_i w_i dW_i
    # in expectation; here check the merge is exactly that sum of drops, mask for mask.
    weights = [0.5, 0.3, 0.2]
    result = merge("dare", experts, weights, p=0.6, seed=5, lam=0.5, rank=12)
    for name in experts[0]:
        drops = [
            drop_and_rescale(w * e[name].delta(), 0.6, mask_generator(5, i, name))
            for i, (w, e) in enumerate(zip(weights, experts))
        ]
        expected = 0.5 * sum(drops)
        # rank 12 >= every module's smaller side, so re-factorising loses nothing
        assert helpers.relative_error(result.modules[name].delta(), expected) < 1e-5


def test_dare_without_drops_is_task_arithmetic(experts, helpers):
    result = merge("dare", experts, [0.5, 0.3, 0.2], p=0.0, lam=2.0, rank=12)
    for name in experts[0]:
        expected = helpers.weighted_sum(experts, [1.0, 0.6, 0.4], name)
        assert helpers.relative_error(result.modules[name].delta(), expected) < 1e-5


def test_dare_ties_without_drops_is_ties_without_trimming(experts, helpers):
    dare_ties = merge("dare_ties", experts, [0.5, 0.3, 0.2], p=0.0, rank=12)
    ties = merge("ties", experts, [0.5, 0.3, 0.2], density=1.0, rank=12)
    for name in experts[0]:
        expected = ties.modules[name].delta()
        assert helpers.relative_error(dare_ties.modules[name].delta(), expected) < 1e-5


def test_dare_ties_runs_with_defaults_and_is_reproducible(experts):
    result = merge("dare_ties", experts, [0.5, 0.3, 0.2])
    again = merge("dare_ties", experts, [0.5, 0.3, 0.2])
    assert result.strategy == "dare_ties"
    assert result.config == {"p": 0.5, "seed": 0, "lam": 1.0, "rank": None}
    assert 0 <= result.truncation_error < 1
    state, alpha, rank = result.state_dict()
    assert rank == 12 and alpha == 12.0
    for name in experts[0]:
        assert torch.equal(result.modules[name].delta(), again.modules[name].delta())
