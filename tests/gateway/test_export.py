"""PEFT and merged-model exports of a real merged gateway on tiny-qwen2, reloaded and compared."""
import json
import os

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

from gateway.export import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, ExportError, ExportExistsError, save_merged_model,
                            save_peft_adapter)
from gateway.generate import generate
from gateway.lora import split_modules
from gateway.merges import merge
from models.loading import LORA_PROJECTIONS, load_base_model

pytestmark = [pytest.mark.slow,  # loads tiny-qwen2 and runs it
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

PROMPTS = ["How do I read a CSV file with pandas?", "SELECT the ten newest rows from orders"]


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_expert(seed: int, rank: int = 2, alpha: float = 4.0) -> dict[str, torch.Tensor]:
    """A rank-2 adapter on every projection of a fresh tiny-qwen2, with small random A and B."""
    base = load_base_model("tiny-qwen2")  # fresh: get_peft_model wraps the model in place
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(LORA_PROJECTIONS), init_lora_weights=False)
    model = get_peft_model(base.model, config)
    state = get_peft_model_state_dict(model)
    g = torch.Generator().manual_seed(seed)
    return {key: 0.3 * torch.randn(value.shape, generator=g) for key, value in state.items()}


@pytest.fixture(scope="module")
def gateway():
    """(tensors, lora) of the exact equal-weight average of two random rank-2 experts."""
    experts = [split_modules(random_expert(seed), alpha=4.0, rank=2) for seed in (1, 2)]
    tensors, alpha, rank = merge("weighted_average", experts, [1, 1]).state_dict()
    assert rank == 4  # ranks concatenate
    return tensors, {"rank": rank, "alpha": alpha, "target_modules": list(LORA_PROJECTIONS)}


@pytest.fixture(scope="module")
def batch():
    tokenizer = load_base_model("tiny-qwen2").tokenizer
    encoded = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    return encoded["input_ids"], encoded["attention_mask"]


def logits(model, batch) -> torch.Tensor:
    input_ids, attention_mask = batch
    with torch.no_grad():
        return model.eval()(input_ids=input_ids, attention_mask=attention_mask).logits


@pytest.fixture(scope="module")
def gateway_logits(gateway, batch):
    """Logits of the in-memory gateway: the base model with the adapter set by PEFT itself."""
    tensors, lora = gateway
    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], target_modules=lora["target_modules"])
    model = get_peft_model(load_base_model("tiny-qwen2").model, config)
    loaded = set_peft_model_state_dict(model, tensors)
    assert not loaded.unexpected_keys
    return logits(model, batch)


def test_gateway_changes_the_model(gateway_logits, batch):
    # otherwise the reload comparisons below would pass for an export that dropped the adapter
    base_logits = logits(load_base_model("tiny-qwen2").model, batch)
    assert (gateway_logits - base_logits).abs().max() > 0.1


def test_peft_adapter_reloads_with_the_same_logits(gateway, gateway_logits, batch, tmp_path):
    tensors, lora = gateway
    out = save_peft_adapter(tmp_path / "adapter", tensors, lora, "tiny-qwen2")
    assert sorted(os.listdir(out)) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 4.0, "tiny-qwen2")
    assert sorted(config["target_modules"]) == sorted(LORA_PROJECTIONS)

    model = PeftModel.from_pretrained(load_base_model("tiny-qwen2").model, str(out))
    torch.testing.assert_close(logits(model, batch), gateway_logits, atol=1e-4, rtol=0)
    # every factor came back bit for bit under PEFT's own names
    reloaded = get_peft_model_state_dict(model, save_embedding_layers=False)
    assert reloaded.keys() == tensors.keys()
    for key, value in tensors.items():
        assert torch.equal(reloaded[key], value)


def test_merged_model_reloads_without_peft(gateway, gateway_logits, batch, tmp_path):
    tensors, lora = gateway
    base = load_base_model("tiny-qwen2")
    before = {k: v.clone() for k, v in base.model.state_dict().items()}
    out = save_merged_model(tmp_path / "merged", base.model, base.tokenizer, tensors, lora)

    model = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in name for name, _ in model.named_parameters())
    torch.testing.assert_close(logits(model, batch), gateway_logits, atol=1e-4, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer(PROMPTS[0])["input_ids"] == base.tokenizer(PROMPTS[0])["input_ids"]
    assert tokenizer.chat_template == base.tokenizer.chat_template
    # the caller's model is untouched: no PEFT wrapper, the same weights
    assert not hasattr(base.model, "peft_config")
    after = base.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_refuses_to_overwrite_a_non_empty_directory(gateway, tmp_path):
    tensors, lora = gateway
    target = tmp_path / "adapter"
    target.mkdir()
    save_peft_adapter(target, tensors, lora, "tiny-qwen2")  # an empty directory is fine
    with pytest.raises(ExportExistsError, match="overwrite=True"):
        save_peft_adapter(target, tensors, lora, "another-base")
    assert json.loads((target / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == "tiny-qwen2"

    save_peft_adapter(target, tensors, lora, "another-base", overwrite=True)
    assert json.loads((target / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == "another-base"
    assert os.listdir(tmp_path) == ["adapter"]  # no temp or old directories left behind


def test_refuses_a_file_in_the_way(gateway, tmp_path):
    tensors, lora = gateway
    (tmp_path / "taken").write_text("not a directory")
    with pytest.raises(ExportExistsError, match="not a directory"):
        save_peft_adapter(tmp_path / "taken", tensors, lora, "tiny-qwen2", overwrite=True)


def test_merged_export_fails_before_merging_into_an_existing_directory(gateway, tmp_path):
    tensors, lora = gateway
    (tmp_path / "merged").mkdir()
    (tmp_path / "merged" / "keep.txt").write_text("mine")
    base = load_base_model("tiny-qwen2")
    with pytest.raises(ExportExistsError):
        save_merged_model(tmp_path / "merged", base.model, base.tokenizer, tensors, lora)
    assert os.listdir(tmp_path / "merged") == ["keep.txt"]


@pytest.mark.parametrize(("change", "message"), [
    ({"rank": 0}, "rank must be a positive integer"),
    ({"rank": 3}, "expected rank 3"),  # the tensors have rank 4
    ({"rank": True}, "rank must be a positive integer"),
    ({"alpha": -1.0}, "alpha must be a positive finite number"),
    ({"alpha": float("nan")}, "alpha must be a positive finite number"),
    ({"target_modules": []}, "non-empty list"),
    ({"target_modules": "q_proj"}, "non-empty list"),
    ({"target_modules": ["q_proj"]}, "not in target_modules"),
    ({"alpha": None}, "alpha"),
])
def test_bad_lora_config_is_refused(gateway, tmp_path, change, message):
    tensors, lora = gateway
    with pytest.raises(ExportError, match=message):
        save_peft_adapter(tmp_path / "adapter", tensors, {**lora, **change}, "tiny-qwen2")
    assert not (tmp_path / "adapter").exists()


def test_missing_lora_key_and_bad_tensors_are_refused(gateway, tmp_path):
    tensors, lora = gateway
    with pytest.raises(ValueError, match="lacks target_modules"):
        save_peft_adapter(tmp_path / "a", tensors, {"rank": 4, "alpha": 4.0}, "tiny-qwen2")
    key = next(iter(tensors))
    with pytest.raises(ExportError, match="NaN or infinity"):
        save_peft_adapter(tmp_path / "a", {**tensors, key: tensors[key] * float("inf")}, lora, "tiny-qwen2")
    unprefixed = {k.removeprefix("base_model.model."): v for k, v in tensors.items()}
    with pytest.raises(ExportError, match="does not start with"):
        save_peft_adapter(tmp_path / "a", unprefixed, lora, "tiny-qwen2")
    assert not (tmp_path / "a").exists()


def test_an_adapter_for_another_model_is_refused(gateway, tmp_path):
    tensors, lora = gateway
    # tiny-qwen2 has layers 0 and 1; an adapter naming layer 7 was made for a deeper model
    deeper = {key.replace("layers.1.", "layers.7."): value for key, value in tensors.items()}
    base = load_base_model("tiny-qwen2")
    with pytest.raises(ExportError, match="does not fit this model"):
        save_merged_model(tmp_path / "merged", base.model, base.tokenizer, deeper, lora)
    assert not (tmp_path / "merged").exists()
    assert list(tmp_path.iterdir()) == []  # the temp directory went too


def test_generate_returns_only_the_new_text(gateway):
    tensors, lora = gateway
    base = load_base_model("tiny-qwen2")
    plain = generate(base.model, base.tokenizer, PROMPTS[0], max_new_tokens=8)
    adapted = generate(base.model, base.tokenizer, PROMPTS[0], tensors, lora, max_new_tokens=8)
    assert isinstance(plain, str) and isinstance(adapted, str)
    assert PROMPTS[0] not in plain and "assistant" not in plain  # the prompt is not echoed
    # greedy: the same call gives the same text, and the adapter did not stick to the base model
    assert generate(base.model, base.tokenizer, PROMPTS[0], max_new_tokens=8) == plain
    assert not hasattr(base.model, "peft_config")
    new_tokens = base.tokenizer(adapted, add_special_tokens=False)["input_ids"]
    assert len(new_tokens) <= 8 + 2  # decoding and re-encoding may split a token differently


def test_generate_needs_tensors_and_lora_together(gateway):
    tensors, _ = gateway
    base = load_base_model("tiny-qwen2")
    with pytest.raises(ValueError, match="both"):
        generate(base.model, base.tokenizer, "hi", tensors=tensors)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(base.model, base.tokenizer, "hi", max_new_tokens=0)
