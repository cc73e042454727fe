"""models.loading / models.presets: the offline preset, fingerprints, local directories, hub failures."""
import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from models import presets
from models.loading import (ModelLoadError, default_target_modules, load_base_model, model_fingerprint,
                           proxy_environment)
from models.presets import tokenizer_sha256

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    return load_base_model("tiny-qwen2")


def test_tiny_qwen2_is_a_real_small_qwen2(tiny):
    model, tok = tiny.model, tiny.tokenizer
    assert isinstance(model, Qwen2ForCausalLM) and not model.training
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (128, 2, 4, 2)
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert c.vocab_size == len(tok) == 3000
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert (tok.pad_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok("SELECT name FROM employees;")["input_ids"]) == "SELECT name FROM employees;"
    assert tiny.model_id == "tiny-qwen2" and len(tiny.fingerprint) == 64


def test_tokenizer_learned_the_corpus(tiny):
    # A BPE trained on the sample data encodes its keywords compactly (whole words or nearly).
    for word in (" SELECT", " return", "def", " Returns"):
        assert len(tiny.tokenizer(word, add_special_tokens=False)["input_ids"]) == 1, word


@pytest.mark.slow
def test_same_fingerprint_in_another_process_with_another_thread_count(tiny):
    child = (
        "import json, sys, torch; torch.set_num_threads(2); sys.path.insert(0, sys.argv[1])\n"
        "from models.loading import load_base_model\nfrom models.presets import tokenizer_sha256\n"
        "b = load_base_model('tiny-qwen2')\n"
        "print(json.dumps([b.fingerprint, tokenizer_sha256(b.tokenizer), torch.get_num_threads()]))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345", TOKENIZERS_PARALLELISM="true")
    out = subprocess.run([sys.executable, "-c", child, str(ROOT)], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout
    fingerprint, tok_hash, threads = json.loads(out.strip().splitlines()[-1])
    assert threads == 2 and torch.get_num_threads() == 1  # conftest runs these tests single-threaded
    assert fingerprint == tiny.fingerprint
    assert tok_hash == tokenizer_sha256(tiny.tokenizer)


def test_fingerprint_changes_with_config_seed_or_weights(tiny, monkeypatch):
    assert model_fingerprint(tiny.model) == tiny.fingerprint  # recomputing gives the same answer
    original = presets.PRESETS["tiny-qwen2"]
    monkeypatch.setitem(presets.PRESETS, "tiny-qwen2", dataclasses.replace(original, intermediate_size=256))
    assert load_base_model("tiny-qwen2").fingerprint != tiny.fingerprint
    monkeypatch.setitem(presets.PRESETS, "tiny-qwen2", dataclasses.replace(original, seed=1))
    reseeded = load_base_model("tiny-qwen2")
    assert reseeded.model.config.to_dict()["fedmoe_preset_settings"]["seed"] == 1
    assert reseeded.fingerprint != tiny.fingerprint
    monkeypatch.setitem(presets.PRESETS, "tiny-qwen2", original)
    nudged = load_base_model("tiny-qwen2")
    with torch.no_grad():
        nudged.model.model.norm.weight[0] += 1e-6
    assert model_fingerprint(nudged.model) != tiny.fingerprint


def test_build_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_base_model("tiny-qwen2")
    assert torch.equal(torch.rand(3), expected)


def test_local_directory_round_trip_keeps_the_fingerprint(tiny, tmp_path):
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    loaded = load_base_model(str(tmp_path))
    assert loaded.model_id == str(tmp_path)
    assert loaded.fingerprint == tiny.fingerprint
    text = "def f(x):\n    return x"
    assert loaded.tokenizer(text)["input_ids"] == tiny.tokenizer(text)["input_ids"]


BAD_DIRECTORIES = {  # config.json's text (None: none), what the one-line message must say
    "missing": (None, "does not exist"),
    "empty": (None, "has no config.json"),
    "broken config.json": ("{not json", "config.json' is not a readable JSON file (Expecting property name"),
    "config.json a list": ("[1]", "config.json' is not a model config"),
    "config.json without model_type": ('{"hidden_size": 8}', "is not a model config (a JSON object with a 'model_type'"),
    # transformers' own error for this runs over five lines: the list of what it tried was cut at "from one of:"
    "unknown model_type, no tokenizer": ('{"model_type": "nosuch"}',
                                         "tokenizer from directory {path!r}: Couldn't instantiate the backend "
                                         "tokenizer from one of: (1) a `tokenizers` library serialization file, (2)"),
}


@pytest.mark.parametrize("case", BAD_DIRECTORIES)
def test_an_unloadable_directory_is_one_complete_line_with_what_was_looked_for_and_the_presets(tmp_path, case):
    config, expected = BAD_DIRECTORIES[case]
    path = tmp_path / "model"
    if case != "missing":
        path.mkdir()
    if config is not None:
        (path / "config.json").write_text(config)
    with pytest.raises(ModelLoadError) as info:
        load_base_model(str(path))
    message = str(info.value)
    assert "\n" not in message and str(path) in message and expected.format(path=str(path)) in message, message
    assert "`--base-model tiny-qwen2` (built offline)" in message and "`--base-model smollm2-135m`" in message
    if case != "missing":
        assert "config.json, the weights (model.safetensors or pytorch_model.bin) and the tokenizer" in message
    assert message.endswith("(after `make smollm2`)."), message  # the end of the message, not a cut


@pytest.mark.parametrize("use_huggingface, source", [(False, "ModelScope"), (True, "Hugging Face")])
def test_hub_id_fails_fast_offline_with_one_clear_message(monkeypatch, use_huggingface, source):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Fails fast = never touches the network (a connect attempt is what costs 22-46 s offline): count them.
    attempts = []

    def no_network(self, address, *args):
        attempts.append(address)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    with pytest.raises(ModelLoadError) as info:
        load_base_model("qwen/Qwen2-0.5B-Instruct", use_huggingface=use_huggingface)
    message = str(info.value)
    assert f"'qwen/Qwen2-0.5B-Instruct' from {source}" in message
    assert "--base-model tiny-qwen2" in message and "\n" not in message
    cause = info.value.__cause__ or (None if info.value.__suppress_context__ else info.value.__context__)
    assert cause is None  # nothing chained: the CLI prints one line
    assert attempts == []  # measured before: ~0.2 s (ModelScope), ~0.01 s (HF), no connection tried


def test_proxy_variables_hidden_only_without_use_proxy(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("http_proxy", "http://proxy.invalid:3128")
    with proxy_environment(use_proxy=False):
        assert "HTTPS_PROXY" not in os.environ and "http_proxy" not in os.environ
    assert os.environ["HTTPS_PROXY"] == os.environ["http_proxy"] == "http://proxy.invalid:3128"
    with proxy_environment(use_proxy=True):
        assert os.environ["HTTPS_PROXY"] == "http://proxy.invalid:3128"


def test_default_target_modules_are_the_seven_projections(tiny):
    assert default_target_modules(tiny.model) == ["q_proj", "k_proj", "v_proj", "o_proj",
                                                  "gate_proj", "up_proj", "down_proj"]
    with pytest.raises(ValueError, match="target_modules"):
        default_target_modules(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_missing_corpus_is_a_load_error_that_says_how_to_fix_it(monkeypatch, tmp_path):
    with pytest.raises(presets.PresetError, match="make_samples.py"):
        presets.build_preset("tiny-qwen2", corpus_dir=tmp_path)

    def no_corpus(name):
        return presets.build_preset(name, corpus_dir=tmp_path)
    monkeypatch.setattr("models.loading.build_preset", no_corpus)
    with pytest.raises(ModelLoadError, match="cannot build preset 'tiny-qwen2'.*make_samples.py"):
        load_base_model("tiny-qwen2")


def test_use_huggingface_with_a_preset_or_directory_says_it_has_no_effect(tiny, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="models.loading"):
        loaded = load_base_model("tiny-qwen2", use_huggingface=True)
    assert loaded.fingerprint == tiny.fingerprint  # still the preset, built here
    assert [r.getMessage() for r in caplog.records] == [
        "--use-huggingface has no effect with --base-model tiny-qwen2: it is a preset built on this machine, "
        "nothing is downloaded"]
    caplog.clear()
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="models.loading"):
        load_base_model(str(tmp_path), use_huggingface=True)
        load_base_model("tiny-qwen2")  # without the flag: nothing to say
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == ["it is a local directory, nothing is downloaded"]
