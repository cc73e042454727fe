import pytest
import torch

from gateway.errors import MergeError
from gateway.lora import LoraModule, join_modules, split_modules

Q = "base_model.model.model.layers.0.self_attn.q_proj"
V = "base_model.model.model.layers.0.self_attn.v_proj"


def test_split_pairs_factors_and_scales_by_alpha_over_rank(helpers):
    state = helpers.random_state({Q: (6, 5), V: (3, 5)}, rank=2, seed=0)
    modules = split_modules(state, alpha=8, rank=2)
    assert set(modules) == {Q, V}
    q = modules[Q]
    assert q.scale == 4.0 and q.rank == 2 and q.shape == (6, 5)
    expected = state[f"{Q}.lora_B.weight"] @ state[f"{Q}.lora_A.weight"] * 4.0
    torch.testing.assert_close(q.delta(), expected)


@pytest.mark.parametrize("missing", ["lora_A", "lora_B"])
def test_split_names_the_unpaired_key(helpers, missing):
    state = helpers.random_state({Q: (6, 5)}, rank=2, seed=0)
    del state[f"{Q}.{missing}.weight"]
    with pytest.raises(MergeError, match=r"q_proj\.lora_[AB]\.weight.*no matching"):
        split_modules(state, alpha=2, rank=2)


def test_split_names_a_factor_whose_rank_disagrees(helpers):
    state = helpers.random_state({Q: (6, 5)}, rank=2, seed=0)
    state[f"{Q}.lora_A.weight"] = torch.zeros(3, 5)
    with pytest.raises(MergeError, match=r"q_proj\.lora_A\.weight.*3 rows, expected rank 2"):
        split_modules(state, alpha=2, rank=2)


def test_split_rejects_keys_that_are_not_lora_factors(helpers):
    state = helpers.random_state({Q: (6, 5)}, rank=2, seed=0)
    state["base_model.model.lm_head.weight"] = torch.zeros(4, 4)
    with pytest.raises(MergeError, match="'base_model.model.lm_head.weight' is not a LoRA factor"):
        split_modules(state, alpha=2, rank=2)


@pytest.mark.parametrize(
    ("alpha", "rank", "quoted"),
    [(0, 2, "got 0"), (2, 0, "got 0"), (2, 2.0, "got 2.0"), (float("nan"), 2, "nan")],
)
def test_split_rejects_bad_lora_config(helpers, alpha, rank, quoted):
    state = helpers.random_state({Q: (6, 5)}, rank=2, seed=0)
    with pytest.raises(MergeError, match=quoted):
        split_modules(state, alpha=alpha, rank=rank)


def test_module_rejects_factors_of_different_rank():
    with pytest.raises(MergeError, match="B has 3 columns but A has 2 rows"):
        LoraModule(A=torch.zeros(2, 5), B=torch.zeros(4, 3), scale=1.0)


def test_join_pads_to_one_rank_and_reproduces_every_delta():
    g = torch.Generator().manual_seed(0)
    modules = {
        Q: LoraModule(torch.randn(5, 7, generator=g), torch.randn(6, 5, generator=g), scale=0.25),
        V: LoraModule(torch.randn(2, 7, generator=g), torch.randn(3, 2, generator=g), scale=3.0),
    }
    state, alpha, rank = join_modules(modules)
    assert rank == 5 and alpha == 5.0
    for prefix, module in modules.items():
        A, B = state[f"{prefix}.lora_A.weight"], state[f"{prefix}.lora_B.weight"]
        assert A.shape[0] == rank and B.shape[1] == rank
        assert A.is_contiguous() and B.is_contiguous()
        torch.testing.assert_close(B @ A * (alpha / rank), module.delta())
    # and back: the joined adapter splits into the same updates
    again = split_modules(state, alpha=alpha, rank=rank)
    for prefix, module in modules.items():
        torch.testing.assert_close(again[prefix].delta(), module.delta())


def test_join_gives_an_empty_update_rank_one():
    empty = LoraModule(A=torch.zeros(0, 4), B=torch.zeros(3, 0), scale=1.0)
    state, alpha, rank = join_modules({Q: empty})
    assert (rank, alpha) == (1, 1.0)
    assert not state[f"{Q}.lora_B.weight"].any()


def test_join_refuses_nothing():
    with pytest.raises(MergeError, match="no modules"):
        join_modules({})
