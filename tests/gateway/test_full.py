"""A model holding a full-parameter expert's weights: exact, checked, the base left alone."""
from __future__ import annotations

import pytest
import torch

from gateway.export import ExportError
from gateway.full import save_full_model, with_full_weights
from models.loading import load_base_model

pytestmark = pytest.mark.slow  # loads tiny-qwen2

@pytest.fixture(scope="module")
def base():
    return load_base_model("tiny-qwen2")


def test_weights_are_copied_into_a_copy_of_the_base(base):
    weights = {n: torch.full_like(p, 0.5) for n, p in base.model.named_parameters()}
    model = with_full_weights(base.model, weights)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert not any(torch.equal(p, weights[n]) for n, p in base.model.named_parameters())


def test_weights_that_do_not_fit_are_refused(base, tmp_path):
    weights = {n: p.detach().clone() for n, p in base.model.named_parameters()}
    name = "model.norm.weight"
    with pytest.raises(ExportError, match=r"weight 'model.norm.weight' has shape \[3\]"):
        with_full_weights(base.model, weights | {name: torch.zeros(3)})
    with pytest.raises(ExportError, match="missing \\['model.norm.weight'\\]"):
        with_full_weights(base.model, {k: v for k, v in weights.items() if k != name})
    with pytest.raises(ExportError):
        save_full_model(tmp_path / "out", base.model, base.tokenizer, {"x.lora_A.weight": torch.zeros(1)})
    assert not (tmp_path / "out").exists()
