"""Base-model loading: offline preset -> local directory -> ModelScope (default) or Hugging Face.

Every failure to obtain a model becomes one ModelLoadError whose message says what to do next;
offline, that is `--base-model tiny-qwen2`. Each loaded model gets a fingerprint (sha256 of its
canonical config and weights) so the coordinator can refuse a worker whose base model differs.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from worker.errors import WorkerError
from worker.presets import PRESETS, PresetError, build_preset
from worker.pretrained import PRETRAINED_PRESETS, load_pretrained_preset

logger = logging.getLogger(__name__)

PRESET_CHOICES = ", ".join([f"`--base-model {name}` (built offline)" for name in PRESETS]
                           + [f"`--base-model {name}` (after `make smollm2`)" for name in PRETRAINED_PRESETS])
OFFLINE_HINT = f"No model hub reachable? Use a local model directory or a preset: {PRESET_CHOICES}."
MODEL_DIRECTORY = ("a directory as save_pretrained writes it: config.json, the weights (model.safetensors or "
                   "pytorch_model.bin) and the tokenizer (tokenizer.json, or tokenizer_config.json with its vocabulary)")
DIRECTORY_HINT = f"--base-model DIR wants {MODEL_DIRECTORY}; or use a preset: {PRESET_CHOICES}."
MESSAGE_LIMIT = 600  # characters of a library's error kept in the one-line message
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Config keys that describe how or where a model was loaded, not what it is.
VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "_commit_hash", "dtype", "torch_dtype",
                                  "_attn_implementation", "_attn_implementation_autoset", "attn_implementation"})


class ModelLoadError(WorkerError):
    """The base model could not be loaded; the message is meant for the user as is."""


@dataclass(frozen=True)
class BaseModel:
    model: PreTrainedModel
    """The causal LM, in eval mode, float32."""
    tokenizer: PreTrainedTokenizerBase
    """Its tokenizer; pad_token is always set."""
    model_id: str
    """What the user asked for, e.g. "tiny-qwen2" or "qwen/Qwen2-0.5B-Instruct"."""
    fingerprint: str
    """sha256 hex of the canonical config JSON and every parameter's bytes, in name order."""


def hub_offline() -> bool:
    """True when the environment forbids hub traffic.

    HF_HUB_OFFLINE is Hugging Face's switch; FedMoE also honours it (and MODELSCOPE_OFFLINE, its
    own name, since modelscope 1.40 has no such switch) for ModelScope by asking only its cache.
    """
    return any(os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
               for var in ("HF_HUB_OFFLINE", "MODELSCOPE_OFFLINE"))


def model_fingerprint(model: PreTrainedModel) -> str:
    """sha256 over the canonical config JSON, then each parameter's name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    config = {k: v for k, v in model.config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS}
    digest.update(json.dumps(config, sort_keys=True, separators=(",", ":"), default=str).encode("utf-8"))
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        tensor = param.detach().to("cpu").contiguous()
        digest.update(f"\0{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode("utf-8"))
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def default_target_modules(model: torch.nn.Module) -> list[str]:
    """The Qwen/Llama attention and MLP projections present in the model, in canonical order."""
    present = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    found = [name for name in LORA_PROJECTIONS if name in present]
    if not found:
        raise ValueError(f"the model has none of the usual LoRA targets ({', '.join(LORA_PROJECTIONS)}); "
                         "pass target_modules explicitly")
    return found


@contextlib.contextmanager
def proxy_environment(use_proxy: bool) -> Iterator[None]:
    """With use_proxy=False, hide HTTP(S)_PROXY/ALL_PROXY from hub clients for the block.

    With use_proxy=True the environment is left alone (requests/httpx use the proxy variables).
    The variables are removed from os.environ and restored afterwards, so this is meant for
    start-up, not for use while other threads make HTTP calls.
    """
    saved = {} if use_proxy else {var: os.environ.pop(var) for var in PROXY_VARIABLES if var in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def load_base_model(spec: str, *, use_huggingface: bool = False, device: str = "cpu",
                    use_proxy: bool = False) -> BaseModel:
    """Load the base model named by spec, trying in order:

    1. an offline preset: `tiny-qwen2`, built in well under a second, or the optional pretrained
       `smollm2-135m`, read from a GGUF file an installed package ships (worker.pretrained);
    2. a local directory (checked with os.path.isdir before any hub is asked);
    3. a hub id: ModelScope `snapshot_download` by default, Hugging Face `from_pretrained` with
       use_huggingface. With HF_HUB_OFFLINE=1 ModelScope is asked for its cache only.

    use_proxy=False hides HTTP(S)_PROXY/ALL_PROXY from the hub download (see proxy_environment).
    The fingerprint is taken on CPU before the model moves to `device`. Any failure raises
    ModelLoadError with a one-line message.
    """
    preset = spec in PRESETS or spec in PRETRAINED_PRESETS
    if use_huggingface and (preset or os.path.isdir(os.path.expanduser(spec))):
        # a warning, not an error: scripts switch --base-model and keep the other flags
        logger.warning("--use-huggingface has no effect with --base-model %s: it is a %s, nothing is downloaded",
                       spec, "preset built on this machine" if preset else "local directory")
    if preset:
        try:
            model, tokenizer = build_preset(spec) if spec in PRESETS else load_pretrained_preset(spec)
        except PresetError as exc:
            raise ModelLoadError(f"cannot build preset {spec!r}: {exc}") from None
    elif os.path.isdir(os.path.expanduser(spec)):
        model, tokenizer = _load_directory(os.path.expanduser(spec))
    elif _looks_like_path(spec):
        raise ModelLoadError(f"base model directory {spec!r} does not exist. {OFFLINE_HINT}")
    else:
        with proxy_environment(use_proxy):
            model, tokenizer = _load_from_hub(spec, use_huggingface)
    return _finish(model, tokenizer, spec, device)


def _looks_like_path(spec: str) -> bool:
    """Hub ids look like "owner/name"; anything else with path syntax is meant as a directory."""
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1 or (os.sep != "/" and os.sep in spec)


def _finish(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, spec: str, device: str) -> BaseModel:
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out; any known token will do
    model = model.to(dtype=torch.float32).eval()  # type: ignore[call-arg]  # transformers' decorated .to confuses mypy
    fingerprint = model_fingerprint(model)
    if device != "cpu":
        model = model.to(device)  # type: ignore[arg-type]  # transformers' decorated .to confuses mypy
    logger.info("base model %s ready (fingerprint %s)", spec, fingerprint[:12])
    return BaseModel(model=model, tokenizer=tokenizer, model_id=spec, fingerprint=fingerprint)


def _load_directory(path: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_config(path)
    part = "tokenizer"
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        part = "model"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for a bad directory
        raise ModelLoadError(f"cannot load a causal LM's {part} from directory {path!r}: {_one_line(exc)}. "
                             f"{DIRECTORY_HINT}") from None
    return model, tokenizer


def _check_config(path: str) -> None:
    """config.json, the first file transformers reads, checked here: its own messages for it run over lines."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ModelLoadError(f"base model directory {path!r} has no config.json. {DIRECTORY_HINT}")
    try:
        with open(config, encoding="utf-8") as f:
            parsed = json.load(f)
    except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError and UnicodeDecodeError
        raise ModelLoadError(f"{config!r} is not a readable JSON file ({_one_line(exc)}). "
                             f"{DIRECTORY_HINT}") from None
    if not isinstance(parsed, dict) or "model_type" not in parsed:
        raise ModelLoadError(f"{config!r} is not a model config (a JSON object with a 'model_type', e.g. \"qwen2\"). "
                             f"{DIRECTORY_HINT}")


def _load_from_hub(model_id: str, use_huggingface: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if use_huggingface:
        source = "Hugging Face"
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_id)
            model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.float32)
            return model, tokenizer
        except Exception as exc:  # anything from the hub client: OSError, HTTP errors, timeouts
            reason = _one_line(exc)
    else:
        source = "ModelScope"
        try:
            from modelscope import snapshot_download

            local_dir = snapshot_download(model_id, local_files_only=hub_offline())
        except Exception as exc:  # NetworkError, CacheNotFound (not an OSError), NotExistError, ...
            reason = _one_line(exc)
        else:
            return _load_directory(local_dir)
    offline = " (offline mode: HF_HUB_OFFLINE is set)" if hub_offline() else ""
    raise ModelLoadError(f"cannot download base model {model_id!r} from {source}{offline}: {reason}. {OFFLINE_HINT}")


def _one_line(exc: BaseException) -> str:
    """The whole of a library's message on one line (its lines joined, not just the first: transformers
    puts the list of what it tried on the next lines), bounded in length."""
    line = " ".join(str(exc).split()).rstrip(". ") or type(exc).__name__
    return line if len(line) <= MESSAGE_LIMIT else line[:MESSAGE_LIMIT - 3] + "..."
