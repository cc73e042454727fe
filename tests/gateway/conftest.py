"""Random LoRA experts shaped like a (very) small Qwen2 adapter."""
from collections.abc import Callable

import pytest
import torch

from gateway.lora import LoraModule, split_modules

# (out_features, in_features) per target module; tall, wide and square like the real thing.
SMALL_SHAPES = {
    "base_model.model.model.layers.0.self_attn.q_proj": (12, 12),
    "base_model.model.model.layers.0.self_attn.k_proj": (4, 12),
    "base_model.model.model.layers.0.mlp.up_proj": (20, 12),
    "base_model.model.model.layers.0.mlp.down_proj": (12, 20),
}

Expert = dict[str, LoraModule]


def random_state(
    shapes: dict[str, tuple[int, int]], rank: int, seed: int
) -> dict[str, torch.Tensor]:
    """A PEFT-style adapter state dict with random non-zero A and B."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for prefix, (out_features, in_features) in shapes.items():
        state[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=g)
        state[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=g)
    return state


@pytest.fixture
def make_expert() -> Callable[..., Expert]:
    def make(rank: int = 4, alpha: float = 8.0, seed: int = 0, shapes=SMALL_SHAPES) -> Expert:
        return split_modules(random_state(shapes, rank, seed), alpha=alpha, rank=rank)

    return make


@pytest.fixture
def experts(make_expert) -> list[Expert]:
    """Three experts of different ranks and alphas."""
    return [
        make_expert(rank=4, alpha=8.0, seed=1),
        make_expert(rank=2, alpha=16.0, seed=2),
        make_expert(rank=6, alpha=6.0, seed=3),
    ]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (torch.linalg.norm(actual - expected) / torch.linalg.norm(expected)).item()


def weighted_sum(experts: list[Expert], coeffs: list[float], name: str) -> torch.Tensor:
    """sum_i c_i * B_i @ A_i * s_i, computed the obvious dense way."""
    return sum(c * (e[name].B @ e[name].A) * e[name].scale for c, e in zip(coeffs, experts))


@pytest.fixture
def helpers():
    """Plain functions for tests (conftest modules cannot be imported under importlib mode)."""
    class Helpers:
        relative_error = staticmethod(relative_error)
        weighted_sum = staticmethod(weighted_sum)
        random_state = staticmethod(random_state)

    return Helpers
