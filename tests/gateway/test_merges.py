"""What every strategy in the registry must honour."""
import pytest
import torch

from gateway.errors import MergeError
from gateway.lora import LoraModule
from gateway.merges import MERGES, merge


def test_registry_holds_every_strategy():
    assert set(MERGES) == {"weighted_average", "task_arithmetic", "ties", "dare", "dare_ties"}


def test_unknown_merge_lists_the_valid_names(experts):
    with pytest.raises(MergeError, match="unknown merge 'average'; choose one of: weighted_av"):
        merge("average", experts, [1, 1, 1])


@pytest.mark.parametrize("name", sorted(MERGES))
def test_state_dict_has_one_rank_and_reproduces_the_modules(name, experts):
    result = merge(name, experts, [0.5, 0.3, 0.2])
    assert result.strategy == name
    state, alpha, rank = result.state_dict()
    assert len(state) == 2 * len(experts[0])
    for prefix, module in result.modules.items():
        A, B = state[f"{prefix}.lora_A.weight"], state[f"{prefix}.lora_B.weight"]
        assert A.shape == (rank, module.shape[1]) and B.shape == (module.shape[0], rank)
        assert A.dtype == B.dtype == torch.float32
        torch.testing.assert_close(B @ A * (alpha / rank), module.delta())


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        ("ties", {"density": 0}, r"density must be in \(0, 1\], got 0"),
        ("ties", {"density": 1.5}, r"density must be in \(0, 1\], got 1.5"),
        ("ties", {"density": "0.2"}, "density must be a finite number, got '0.2'"),
        ("dare", {"p": 1.0}, r"p must be in \[0, 1\), got 1.0"),
        ("dare", {"p": -0.1}, r"p must be in \[0, 1\), got -0.1"),
        ("dare_ties", {"p": 1}, r"p must be in \[0, 1\), got 1"),
        ("dare", {"seed": 1.5}, "seed must be an integer, got 1.5"),
        ("weighted_average", {"rank": -2}, "rank must be a positive integer or None, got -2"),
        ("task_arithmetic", {"rank": 0}, "got 0"),
        ("ties", {"rank": 2.5}, "got 2.5"),
        ("task_arithmetic", {"lam": float("inf")}, "lam must be a finite number, got inf"),
        (
            "weighted_average",
            {"density": 0.2},
            "unknown config key 'density' for merge 'weighted_average'; valid keys: rank$",
        ),
        (
            "ties",
            {"lambda": 0.5},
            "unknown config key 'lambda' for merge 'ties'; valid keys: density, lam, rank$",
        ),
    ],
)
def test_bad_config_is_refused_quoting_the_value(name, config, message, experts):
    with pytest.raises(MergeError, match=message):
        merge(name, experts, [1, 1, 1], **config)


@pytest.mark.parametrize("name", sorted(MERGES))
def test_every_merge_checks_its_inputs(name, experts, make_expert):
    with pytest.raises(MergeError, match="no experts to merge"):
        merge(name, [], [])
    with pytest.raises(MergeError, match="got 2 weights for 3 experts"):
        merge(name, experts, [1, 1])
    with pytest.raises(MergeError, match="all zero"):
        merge(name, experts, [0, 0, 0])

    other_shapes = {"base_model.model.model.layers.0.self_attn.q_proj": (12, 12)}
    with pytest.raises(MergeError, match=r"expert 1 lacks module '.*layers.0.mlp.down_proj'"):
        merge(name, [experts[0], make_expert(shapes=other_shapes)], [1, 1])

    wrong = dict(experts[1])
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    wrong[key] = LoraModule(A=torch.ones(2, 13), B=torch.ones(12, 2), scale=1.0)
    with pytest.raises(MergeError, match=r"'.*q_proj' is \(12, 13\) in expert 1 but \(12, 12\)"):
        merge(name, [experts[0], wrong], [1, 1])


def test_errors_are_value_errors_with_a_code():
    assert issubclass(MergeError, ValueError)
    assert MergeError.code == "merge_error"
