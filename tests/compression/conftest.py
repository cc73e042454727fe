"""Shared fixtures for the compression tests."""
import pytest
import torch

LORA_MANIFEST = [("layers.0.lora_A", (8, 896)), ("layers.0.lora_B", (896, 8))]


@pytest.fixture
def lora_manifest():
    return list(LORA_MANIFEST)


@pytest.fixture
def lora_update():
    """A seeded LoRA A/B delta pair of the sizes workers push."""
    gen = torch.Generator().manual_seed(1234)
    return {name: torch.randn(shape, generator=gen) * 0.01 for name, shape in LORA_MANIFEST}


@pytest.fixture
def randn():
    """Factory of seeded flat float32 Gaussian vectors: ``randn(n, seed=0, scale=1.0)``."""

    def make(n: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale

    return make
