import pytest
import torch

from gateway.lora import LoraModule
from gateway.merges import merge
from gateway.merges.base import Scratch
from gateway.merges.ties import SignVote, elect_and_merge, kth_largest, trim, trim_in_place

NAME = "m"


def expert_with_delta(delta: list[list[float]]) -> dict[str, LoraModule]:
    """An expert whose update is exactly `delta` (A = identity)."""
    B = torch.tensor(delta)
    return {NAME: LoraModule(A=torch.eye(B.shape[1]), B=B, scale=1.0)}


D1 = [[4.0, -1.0], [0.5, 2.0]]
D2 = [[-3.0, 2.0], [1.0, -0.2]]
D3 = [[1.0, -5.0], [-0.1, -3.0]]

# Hand-worked:
# density 0.5 keeps 2 of 4 entries each:  [[4, 0], [0, 2]]   [[-3, 2], [0, 0]]   [[0, -5], [0, -3]]
#   sums [[1, -3], [0, -1]] -> signs [[+, -], [0, -]]
#   agreeing entries: (0,0) 4; (0,1) -5; (1,0) none; (1,1) -3           -> [[4, -5], [0, -3]]
# density 0.75 keeps 3 of 4:  [[4, -1], [0, 2]]   [[-3, 2], [1, 0]]   [[1, -5], [0, -3]]
#   sums [[2, -4], [1, -1]] -> signs [[+, -], [+, -]]
#   disjoint means: (0,0) (4+1)/2; (0,1) (-1-5)/2; (1,0) 1/1; (1,1) -3/1  -> [[2.5, -3], [1, -3]]
# weights [1, 2, 1], density 0.5: D2 doubled keeps [[-6, 4], [0, 0]]
#   sums [[-2, -1], [0, -1]] -> (0,0) -6; (0,1) -5; (1,1) -3             -> [[-6, -5], [0, -3]]
CASES = [
    ([1, 1, 1], {"density": 0.5}, [[4.0, -5.0], [0.0, -3.0]]),
    ([1, 1, 1], {"density": 0.75}, [[2.5, -3.0], [1.0, -3.0]]),
    ([1, 1, 1], {"density": 0.75, "lam": 0.5}, [[1.25, -1.5], [0.5, -1.5]]),
    ([1, 2, 1], {"density": 0.5}, [[-6.0, -5.0], [0.0, -3.0]]),
]


@pytest.mark.parametrize(("weights", "config", "expected"), CASES)
def test_ties_matches_the_hand_computed_merge(weights, config, expected):
    experts = [expert_with_delta(d) for d in (D1, D2, D3)]
    result = merge("ties", experts, weights, **config)
    torch.testing.assert_close(result.modules[NAME].delta(), torch.tensor(expected))
    assert result.truncation_error == pytest.approx(0.0, abs=1e-6)  # rank 2 of 2x2 is exact


def test_trim_keeps_the_largest_magnitudes_and_all_ties_at_the_cut():
    delta = torch.tensor([[0.1, -0.9, 0.5], [-0.5, 0.2, 0.0]])
    assert torch.equal(trim(delta, 1 / 6), torch.tensor([[0.0, -0.9, 0.0], [0.0, 0.0, 0.0]]))
    # keeping 2 of 6: 0.5 and -0.5 tie for second place, both stay
    assert torch.equal(trim(delta, 2 / 6), torch.tensor([[0.0, -0.9, 0.5], [-0.5, 0.0, 0.0]]))
    assert torch.equal(trim(delta, 1.0), delta)


def test_kth_largest_agrees_with_kthvalue():
    g = torch.Generator().manual_seed(0)
    for values in (
        torch.randn(100_000, generator=g).abs() ** 4,
        torch.cat([torch.zeros(5000), torch.rand(500, generator=g)]),
        torch.tensor([2.0, 2.0, 2.0, 1.0]),
        torch.zeros(3),
    ):
        n = values.numel()
        for k in {1, 2, n // 5 or 1, n // 2 or 1, n}:
            assert kth_largest(values, k) == values.kthvalue(n - k + 1).values


def test_ties_reports_the_error_of_refactorising_its_dense_result(experts):
    full = merge("ties", experts, [0.5, 0.3, 0.2], rank=1000)  # 20x12 at most: exact
    cut = merge("ties", experts, [0.5, 0.3, 0.2], rank=2)
    assert full.truncation_error == pytest.approx(0.0, abs=1e-5)
    for name, module in full.modules.items():
        dense = module.delta()
        s = torch.linalg.svdvals(dense.double())
        eckart_young = ((s[2:] ** 2).sum() / (s**2).sum()).sqrt().item()
        assert cut.modules[name].rank == 2
        assert cut.module_errors[name] == pytest.approx(eckart_young, abs=1e-5)


def test_ties_default_rank_is_the_sum_of_expert_ranks(experts):
    result = merge("ties", experts, [1, 1, 1])
    # ranks 4 + 2 + 6 = 12, capped by each module's smaller side (4 for the 4x12 k_proj)
    assert {m.rank for m in result.modules.values()} == {12, 4}
    assert result.state_dict()[2] == 12


def test_kth_largest_on_large_tensors_agrees_with_kthvalue():
    """Past the sampled bracket's threshold, with repeated values and an all-but-zero tensor too."""
    g = torch.Generator().manual_seed(1)
    dense = (torch.randn(520, 8, generator=g) @ torch.randn(8, 600, generator=g)).abs().flatten()  # > 4 x SAMPLE
    coarse = (dense * 4).round()  # many ties
    sparse = torch.zeros(300_000)
    sparse[:1000] = torch.rand(1000, generator=g)
    for values in (dense, coarse, sparse):
        n = values.numel()
        for k in (1, n // 100, n // 5, n - 1):
            assert kth_largest(values, k) == values.kthvalue(n - k + 1).values, k


def sparse_updates(seed: int, zeros: float) -> torch.Tensor:
    """Three (40, 30) updates with a fraction of exact zeros, coarse values (ties in magnitude)."""
    g = torch.Generator().manual_seed(seed)
    updates = (torch.randn(3, 40, 30, generator=g) * 4).round() / 4
    return updates * (torch.rand(3, 40, 30, generator=g) >= zeros)


@pytest.mark.parametrize("zeros", [0.0, 0.5, 0.97])
def test_sign_vote_equals_the_stacked_election(zeros):
    updates = sparse_updates(int(zeros * 100), zeros)
    updates[:, 0, :3] = torch.tensor([[1.0, 2.0, 0.0], [-1.0, -2.0, 0.0], [0.0, 0.0, 0.0]])  # expert x entry: totals of 0
    vote = SignVote(updates.shape[1:], Scratch())
    for t in updates:
        vote.add(t.clone())
    expected = elect_and_merge(updates)
    torch.testing.assert_close(vote.disjoint_mean(), expected, rtol=1e-6, atol=0)
    assert not expected[0, :3].any()


@pytest.mark.parametrize(("zeros", "density"), [(0.0, 0.2), (0.5, 0.3), (0.97, 0.2), (0.0, 1.0)])
def test_trim_in_place_is_trim_and_marks_exactly_the_non_zeros(zeros, density):
    for update in sparse_updates(7, zeros):
        in_place = update.clone()
        kept, magnitude = trim_in_place(in_place, density, Scratch())
        assert torch.equal(in_place, trim(update, density))
        assert torch.equal(kept, (in_place != 0).float())  # at 97% zeros the cut is at 0: zeros not kept
        assert torch.equal(magnitude, in_place.abs())


def test_ties_merge_equals_the_reference_functions(experts, helpers):
    """The in-place merge against trim + elect_and_merge on the dense updates, module by module."""
    weights = [0.5, -0.3, 0.2]
    result = merge("ties", experts, weights, density=0.4, lam=1.5, rank=12)
    for name in experts[0]:
        trimmed = torch.stack([trim(w * e[name].delta(), 0.4) for w, e in zip(weights, experts)])
        expected = 1.5 * elect_and_merge(trimmed)
        assert helpers.relative_error(result.modules[name].delta(), expected) < 1e-5
