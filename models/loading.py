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
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from models.errors import ModelError
from models.presets import PRESETS, PresetError, build_preset
from models.pretrained import PRETRAINED_PRESETS, load_pretrained_preset

logger = logging.getLogger(__name__)

PRESET_CHOICES = ", ".join([f"`--base-model {name}` (built offline)" for name in PRESETS]
                           + [f"`--base-model {name}` (after `make smollm2`)" for name in PRETRAINED_PRESETS])
OFFLINE_HINT = f"No model hub reachable? Use a local model directory or a preset: {PRESET_CHOICES}."
MODEL_DIRECTORY = ("a directory as save_pretrained writes it: config.json, the weights (model.safetensors or "
                   "pytorch_model.bin) and the tokenizer (tokenizer.json, or tokenizer_config.json with its vocabulary)")
DIRECTORY_HINT = f"--base-model DIR wants {MODEL_DIRECTORY}; or use a preset: {PRESET_CHOICES}."
MESSAGE_LIMIT = 600  # characters of a library's error kept in the one-line message
PROBE_SECONDS = 3.0
"""How long the hub's address may take to accept a TCP connection before it counts as unreachable
(the hub clients themselves retry for 22-46 s before they give up)."""
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Config keys that describe how or where a model was loaded, not what it is.
VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "_commit_hash", "dtype", "torch_dtype",
                                  "_attn_implementation", "_attn_implementation_autoset", "attn_implementation"})


class ModelLoadError(ModelError):
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
       `smollm2-135m`, read from a GGUF file an installed package ships (models.pretrained);
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
        return _load_from_hugging_face(model_id)
    cached = find_in_modelscope_cache(model_id)
    if cached is not None:  # no network call at all: snapshot_download would still ask the hub for the revision
        logger.info("base model %s found in the ModelScope cache: %s", model_id, cached)
        return _load_directory(str(cached))
    looked = f"not in the ModelScope cache (looked for {_cache_places(model_id)})"
    _fail_fast_if_unreachable(model_id, "ModelScope", os.environ.get("MODELSCOPE_ENDPOINT") or MODELSCOPE_ENDPOINT,
                              looked)
    try:
        from modelscope import snapshot_download

        local_dir = snapshot_download(model_id)
    except Exception as exc:  # NetworkError, NotExistError, ... (CacheNotFound is not an OSError)
        raise ModelLoadError(f"cannot download base model {model_id!r} from ModelScope: {_one_line(exc)}; it is "
                             f"{looked}. {OFFLINE_HINT}") from None
    return _load_directory(local_dir)


def _load_from_hugging_face(model_id: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(local_only: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        tokenizer = AutoTokenizer.from_pretrained(model_id, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.float32, local_files_only=local_only)
        return model, tokenizer

    try:
        return load(local_only=True)  # the Hugging Face cache first, without a network call
    except Exception as exc:  # OSError and friends: not (wholly) in the cache
        reason = _one_line(exc)
    _fail_fast_if_unreachable(model_id, "Hugging Face", os.environ.get("HF_ENDPOINT") or HUGGING_FACE_ENDPOINT,
                              "not in the Hugging Face cache")
    try:
        return load(local_only=False)
    except Exception as exc:  # anything from the hub client: OSError, HTTP errors, timeouts
        reason = _one_line(exc)
    raise ModelLoadError(f"cannot download base model {model_id!r} from Hugging Face: {reason}. {OFFLINE_HINT}")


MODELSCOPE_ENDPOINT = "https://modelscope.cn"
"""ModelScope's API address (modelscope_hub's default; $MODELSCOPE_ENDPOINT overrides it, as there)."""
HUGGING_FACE_ENDPOINT = "https://huggingface.co"


def modelscope_cache_root() -> Path:
    """$MODELSCOPE_CACHE, else ~/.cache/modelscope: where modelscope 1.40 keeps what it downloaded."""
    return Path(os.environ.get("MODELSCOPE_CACHE") or Path.home() / ".cache" / "modelscope").expanduser()


def modelscope_cache_places(model_id: str) -> list[Path]:
    """Where a ModelScope download of model_id can be, newest layout first (modelscope 1.40.2's
    snapshot_download and find_reusable_legacy_repo_dir, read in their source):

    models/<owner>--<name>/snapshots/<revision>/   modelscope 1.40 (modelscope_hub)
    models/<owner>/<name, '.' as '___'>/           1.x SDKs (e.g. models/qwen/Qwen2-0___5B-Instruct)
    hub/models/<owner>/<masked name>/              1.x SDKs whose cache root was ~/.cache/modelscope/hub
    hub/<owner>/<name>/, <owner>/<name>/           older SDKs, and MODELSCOPE_CACHE pointed at a flat directory
    """
    root = modelscope_cache_root()
    owner, _, name = model_id.partition("/")
    masked = name.replace(".", "___")
    snapshots = root / "models" / f"{owner}--{name}" / "snapshots"
    revisions = sorted(snapshots.iterdir(), key=lambda p: (p.name != "master", p.name)) if snapshots.is_dir() else []
    return [*revisions, *(root / part / owner / n for part in ("models", "hub/models", "hub", ".")
                          for n in dict.fromkeys((masked, name)))]


def find_in_modelscope_cache(model_id: str) -> Path | None:
    """The first place of modelscope_cache_places holding a config.json, or None (never a network call)."""
    if model_id.count("/") != 1:
        return None
    return next((place for place in modelscope_cache_places(model_id) if (place / "config.json").is_file()), None)


def _cache_places(model_id: str) -> str:
    root = modelscope_cache_root()
    owner, _, name = model_id.partition("/")
    return (f"{root}/models/{owner}--{name}/snapshots/*, and {owner}/{name.replace('.', '___')} under "
            f"{root}/models, {root}/hub/models, {root}/hub and {root}")


def _fail_fast_if_unreachable(model_id: str, source: str, endpoint: str, looked: str) -> None:
    """Offline, or with the hub's address unreachable, one line at once instead of the client's long retries."""
    if hub_offline():
        raise ModelLoadError(f"cannot download base model {model_id!r} from {source} (offline mode: HF_HUB_OFFLINE "
                             f"is set): it is {looked}. {OFFLINE_HINT}")
    if any(os.environ.get(var) for var in PROXY_VARIABLES):
        return  # through a proxy only the client itself can tell
    problem = unreachable(endpoint, PROBE_SECONDS)
    if problem is not None:
        raise ModelLoadError(f"cannot download base model {model_id!r} from {source}: {problem}, and it is {looked}. "
                             f"{OFFLINE_HINT}")


def unreachable(endpoint: str, timeout: float) -> str | None:
    """None when the endpoint's host accepts a TCP connection within timeout; else what went wrong."""
    parts = urlsplit(endpoint)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    outcome: list[str | None] = []

    def connect() -> None:  # in a thread: the name lookup has no timeout of its own
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(f"{host}:{port} is unreachable ({_one_line(exc)})")

    thread = threading.Thread(target=connect, name="hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"{host}:{port} did not answer within {timeout:.0f} s"


def _one_line(exc: BaseException) -> str:
    """The whole of a library's message on one line (its lines joined, not just the first: transformers
    puts the list of what it tried on the next lines), bounded in length."""
    line = " ".join(str(exc).split()).rstrip(". ") or type(exc).__name__
    return line if len(line) <= MESSAGE_LIMIT else line[:MESSAGE_LIMIT - 3] + "..."
