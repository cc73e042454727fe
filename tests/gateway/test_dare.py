import pytest
import torch

from gateway.merges import merge
from gateway.merges.dare import drop_and_rescale, keep_mask, mask_generator


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


def draw_bytes(generator: torch.Generator, n: int) -> torch.Tensor:
    """The first random byte of each entry, as keep_mask draws them."""
    words = torch.empty((n + 7) // 8, dtype=torch.int64).random_(-(2**63), None, generator=generator)
    return words.view(torch.uint8)[:n].long()


@pytest.mark.parametrize("k", [0, 1, 128, 255])
def test_keep_mask_keeps_a_byte_at_or_above_p(k):
    """p = k/256 has one base-256 digit: entry j is kept iff its first random byte is >= k."""
    mask = keep_mask((64, 64), k / 256, mask_generator(1, 0, "m"))
    expected = (draw_bytes(mask_generator(1, 0, "m"), 64 * 64) >= k).float().view(64, 64)
    assert torch.equal(mask, expected)


def test_keep_mask_resolves_ties_with_further_digits():
    """p = (100 + 3/4) / 256: an entry whose first byte is 100 (1/256 of them) is kept with
    probability 1/4, decided by its next 64 bits; other bytes decide at once."""
    n = 1 << 20
    p = 100.75 / 256
    mask = keep_mask((n,), p, mask_generator(2, 0, "m"))
    first = draw_bytes(mask_generator(2, 0, "m"), n)
    assert torch.equal(mask[first != 100], (first[first != 100] > 100).float())
    ties = mask[first == 100]
    assert ties.numel() == pytest.approx(n / 256, rel=0.1)
    assert ties.mean().item() == pytest.approx(0.25, abs=0.03)  # 4.4 standard deviations
    assert mask.mean().item() == pytest.approx(1 - p, abs=0.003)


def test_dare_merges_reuse_no_mask_between_modules_or_experts(make_expert, helpers):
    """Same-shaped modules share scratch buffers: each must still get its own (expert, module) mask."""
    shapes = {f"layers.{i}.q_proj": (16, 16) for i in range(3)}
    experts = [make_expert(rank=4, seed=s, shapes=shapes) for s in range(2)]
    result = merge("dare", experts, [1.0, 1.0], p=0.5, seed=3, rank=16)
    for name in shapes:
        expected = sum(drop_and_rescale(e[name].delta(), 0.5, mask_generator(3, i, name))
                       for i, e in enumerate(experts))
        assert helpers.relative_error(result.modules[name].delta(), expected) < 1e-5
