"""Real PEFT adapters on a tiny Qwen2: split, merge, join, load back, check the merged weights."""
import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import Qwen2Config, Qwen2ForCausalLM

from gateway.lora import split_modules
from gateway.merges import merge

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEFT_PREFIX = "base_model.model."

# transformers 5.23 says "`is_gradient_checkpointing` is deprecated" with backticks, which the
# filter in pytest.ini (written without them) does not match.
pytestmark = [pytest.mark.slow,  # loads tiny-qwen2 and runs it
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)  # every call builds the same base weights
    config = Qwen2Config(
        hidden_size=16,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    return Qwen2ForCausalLM(config)


def trained_looking_expert(rank: int, alpha: float, seed: int):
    model = tiny_qwen2()
    torch.manual_seed(seed)
    # init_lora_weights=False: B is random too, as after training, instead of zero
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS, init_lora_weights=False)
    state = get_peft_model_state_dict(get_peft_model(model, config))
    return split_modules(state, alpha=alpha, rank=rank)


@pytest.mark.parametrize(
    ("name", "config"), [("weighted_average", {}), ("weighted_average", {"rank": 3}), ("ties", {})]
)
def test_merged_adapter_loads_into_peft_and_applies_the_merged_updates(name, config):
    # different ranks and alphas, as experts trained by different workers may have
    ranks_alphas_seeds = [(4, 8, 1), (2, 32, 2), (8, 8, 3)]
    experts = [trained_looking_expert(r, alpha, seed) for r, alpha, seed in ranks_alphas_seeds]
    assert len(experts[0]) == 2 * len(TARGETS)
    result = merge(name, experts, [0.5, 0.3, 0.2], **config)
    state, alpha, rank = result.state_dict()

    model = get_peft_model(
        tiny_qwen2(), LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS)
    )
    loaded = set_peft_model_state_dict(model, state)
    assert not loaded.unexpected_keys
    assert not [key for key in loaded.missing_keys if "lora_" in key]
    merged = model.merge_and_unload().state_dict()
    base = tiny_qwen2().state_dict()

    for prefix, module in result.modules.items():
        weight = prefix.removeprefix(PEFT_PREFIX) + ".weight"
        applied = merged[weight] - base[weight]
        torch.testing.assert_close(applied, module.delta(), rtol=1e-4, atol=1e-5)
    if name == "weighted_average" and not config:  # exact: the sum of the experts' own updates
        for prefix in result.modules:
            weight = prefix.removeprefix(PEFT_PREFIX) + ".weight"
            expected = sum(w * e[prefix].delta() for w, e in zip([0.5, 0.3, 0.2], experts))
            applied = merged[weight] - base[weight]
            torch.testing.assert_close(applied, expected, rtol=1e-4, atol=1e-5)
