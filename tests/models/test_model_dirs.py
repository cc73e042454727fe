"""Models people already have: a local Hugging Face directory (safetensors or .bin) and the ModelScope cache
layouts of modelscope 1.40, found without a network call; the same weights give the same fingerprint from
everywhere; no cache and no hub is one line at once."""
import socket

import pytest

from models.loading import ModelLoadError, find_in_modelscope_cache, load_base_model

MODEL_ID = "qwen/Qwen2-0.5B-Instruct"
LAYOUTS = {  # modelscope 1.40 (modelscope_hub) and the 1.x SDKs' masked-name directory
    "snapshots": "models/qwen--Qwen2-0.5B-Instruct/snapshots/master",
    "masked": "models/qwen/Qwen2-0___5B-Instruct",
}


@pytest.fixture(scope="module")
def tiny():
    return load_base_model("tiny-qwen2")


@pytest.fixture
def no_network(monkeypatch):
    """Every connection attempt is recorded and refused."""
    attempts = []

    def refuse(self, address, *args):
        attempts.append(address)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return attempts


def save(base, path, **options):
    base.model.save_pretrained(path, **options)
    base.tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_default_model_is_found_in_the_modelscope_cache_offline(tiny, tmp_path, monkeypatch, no_network, layout):
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # found before any hub is asked, offline switch or not
    save(tiny, tmp_path / LAYOUTS[layout])
    assert find_in_modelscope_cache(MODEL_ID) == tmp_path / LAYOUTS[layout]
    loaded = load_base_model(MODEL_ID)
    assert loaded.model_id == MODEL_ID and loaded.fingerprint == tiny.fingerprint
    assert no_network == []


def test_the_home_cache_is_looked_in_without_modelscope_cache(tiny, tmp_path, monkeypatch, no_network):
    monkeypatch.delenv("MODELSCOPE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    place = save(tiny, tmp_path / ".cache" / "modelscope" / "hub" / "models" / "qwen" / "Qwen2-0___5B-Instruct")
    assert find_in_modelscope_cache(MODEL_ID) == place


def test_a_bin_directory_loads_the_same_weights_with_the_same_fingerprint(tiny, tmp_path):
    import torch  # transformers 5 writes only safetensors: an older save_pretrained's .bin, written by hand

    path = tmp_path / "bin"
    tiny.model.config.save_pretrained(path)
    tiny.tokenizer.save_pretrained(path)
    torch.save(tiny.model.state_dict(), path / "pytorch_model.bin")
    assert load_base_model(str(path)).fingerprint == tiny.fingerprint


def test_no_cache_and_an_unreachable_hub_is_one_line_naming_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as s:  # a port nothing listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(ModelLoadError) as info:
        load_base_model(MODEL_ID)
    message = str(info.value)
    assert message.startswith(f"cannot download base model '{MODEL_ID}' from ModelScope: 127.0.0.1:{port} is "
                              "unreachable (")
    assert f"not in the ModelScope cache (looked for {tmp_path}/models/qwen--Qwen2-0.5B-Instruct/snapshots/*" in message
    assert "qwen/Qwen2-0___5B-Instruct" in message and "`--base-model tiny-qwen2` (built offline)" in message
    assert "\n" not in message
