import math

import numpy as np
import pytest
import torch

from gateway.errors import MergeError
from gateway.lora import split_modules
from gateway.merges import merge


def test_one_hot_weights_reproduce_that_expert(experts):
    result = merge("weighted_average", experts, [1, 0, 0])
    assert result.weights == [1.0, 0.0, 0.0]
    assert result.truncation_error is None
    for name, module in experts[0].items():
        assert (result.modules[name].delta() - module.delta()).abs().max() <= 1e-6
        assert result.modules[name].rank == module.rank  # zero-weight experts add no rank


def test_average_is_the_exact_weighted_sum_of_full_updates(experts, helpers):
    # ranks 4, 2, 6 and alphas 8, 16, 6; weights normalised: [2, 1, 1] -> [.5, .25, .25]
    result = merge("weighted_average", experts, [2, 1, 1])
    assert result.weights == [0.5, 0.25, 0.25]
    for name in experts[0]:
        expected = helpers.weighted_sum(experts, [0.5, 0.25, 0.25], name)
        assert helpers.relative_error(result.modules[name].delta(), expected) < 1e-5
        assert result.modules[name].rank == 4 + 2 + 6


def test_averaging_factors_separately_is_wrong(make_expert, helpers):
    """mean(B_i) @ mean(A_i) is not mean(B_i @ A_i) (docs/architecture.md, "Exact gateway")."""
    experts = [make_expert(rank=4, alpha=8.0, seed=s) for s in range(3)]
    exact = merge("weighted_average", experts, [1, 1, 1])
    for name in experts[0]:
        mean_A = sum(e[name].A for e in experts) / 3
        mean_B = sum(e[name].B for e in experts) / 3
        naive = mean_B @ mean_A * experts[0][name].scale
        assert helpers.relative_error(naive, exact.modules[name].delta()) > 0.3


def test_svd_at_full_rank_equals_concatenation(experts, helpers):
    exact = merge("weighted_average", experts, [0.5, 0.3, 0.2])
    svd = merge("weighted_average", experts, [0.5, 0.3, 0.2], rank=12)
    assert svd.truncation_error == pytest.approx(0.0, abs=1e-6)
    for name in experts[0]:
        assert helpers.relative_error(svd.modules[name].delta(), exact.modules[name].delta()) < 1e-5


def test_svd_at_lower_rank_reports_the_frobenius_error(experts, helpers):
    result = merge("weighted_average", experts, [0.5, 0.3, 0.2], rank=3)
    assert result.config == {"rank": 3}
    squared_error = squared_norm = 0.0
    for name in experts[0]:
        dense = helpers.weighted_sum(experts, [0.5, 0.3, 0.2], name)
        approx = result.modules[name].delta()
        assert result.modules[name].rank == 3
        # best rank-3 error by Eckart-Young, and the error the factors actually have
        s = torch.linalg.svdvals(dense.double())
        eckart_young = math.sqrt((s[3:] ** 2).sum() / (s**2).sum())
        assert result.module_errors[name] == pytest.approx(eckart_young, abs=1e-6)
        assert helpers.relative_error(approx, dense) == pytest.approx(eckart_young, abs=1e-5)
        squared_error += torch.linalg.norm(dense - approx).item() ** 2
        squared_norm += torch.linalg.norm(dense).item() ** 2
    assert 0.05 < result.truncation_error < 1
    overall = math.sqrt(squared_error / squared_norm)
    assert result.truncation_error == pytest.approx(overall, abs=1e-5)


def test_numpy_weights_are_plain_numbers(experts):
    result = merge("weighted_average", experts, np.array([3.0, 1.0, 0.0], dtype=np.float32))
    assert result.weights == [0.75, 0.25, 0.0]
    assert all(type(w) is float for w in result.weights)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([1, -0.5, 1], r"weights\[1\] is -0.5"),
        ([0, 0, 0], r"all zero \(\[0, 0, 0\]\)"),
        ([1, 1], "got 2 weights for 3 experts"),
        ([1, float("nan"), 1], r"weights\[1\] must be a finite number, got nan"),
    ],
)
def test_bad_weights_are_refused(experts, weights, message):
    with pytest.raises(MergeError, match=message):
        merge("weighted_average", experts, weights)


def test_qwen2_half_billion_adapter_merges_by_concatenating_ranks(helpers):
    hidden, intermediate, kv = 896, 4864, 128
    shapes = {}
    for layer in range(24):
        prefix = f"base_model.model.model.layers.{layer}"
        for module, shape in {
            "self_attn.q_proj": (hidden, hidden),
            "self_attn.k_proj": (kv, hidden),
            "self_attn.v_proj": (kv, hidden),
            "self_attn.o_proj": (hidden, hidden),
            "mlp.gate_proj": (intermediate, hidden),
            "mlp.up_proj": (intermediate, hidden),
            "mlp.down_proj": (hidden, intermediate),
        }.items():
            shapes[f"{prefix}.{module}"] = shape
    experts = [split_modules(helpers.random_state(shapes, 8, seed), 16, 8) for seed in range(3)]
    # Speed is a benchmark (python -m bench.merge_speed: every strategy as a ratio to this exact average,
    # measured in the same run); here only what the merge makes of a real model's shapes.
    result = merge("weighted_average", experts, [0.5, 0.3, 0.2])
    state, alpha, rank = result.state_dict()
    assert len(state) == 2 * 24 * 7 and rank == 24
