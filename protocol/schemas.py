"""Request metadata both sides build and parse, validated once at the edge.

Tensor bodies travel as raw bytes; the small JSON metadata that goes with them
travels in one request header (``UPDATE_HEADER`` / ``EXPERT_HEADER``), so a
body can be streamed to disk without a multipart parser.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from protocol.dp_cohort import DPCohortSum
from protocol.errors import BadRequest
from protocol.integrity import is_content_id


def is_finite_number(value: object) -> bool:
    """A real int or float that is not NaN or infinite (JSON numbers a client sent)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


API_PREFIX = "/api/v1"
UPDATE_HEADER = "X-FedMoE-Update"
EXPERT_HEADER = "X-FedMoE-Expert"
VERSION_HEADER = "X-FedMoE-Version"
WORKER_HEADER = "X-FedMoE-Worker"  # optional on pulls: lets the coordinator tally bytes per worker
REDIRECT_HEADER = "X-FedMoE-Accept-Redirect"  # "1": the client follows a 307 to a presigned object-store URL
RAW_CODEC = "safetensors"  # an uncompressed update: the body is a safetensors file

# Matched with fullmatch: "$" also matches before a trailing newline, so "e\n" used to pass.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# Counts stored in SQLite's signed 64-bit integers and summed there (samples_seen): far below 2**63.
MAX_COUNT = 10**12
UPDATE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
MAX_BATCH_MEMBERS = 256
"""Worker updates one relay batch may carry (its member list travels in the update header: ~120 bytes each)."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays and objects accepted in request JSON; ours is at most 3 deep. Python's
parser recurses per level, so 3,000 levels were a RecursionError (a 500) and ~26x the body in memory."""
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def check_name(value: object, what: str) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise BadRequest(f"{what} must be 1-64 characters of letters, digits, '_', '.', '-' "
                         f"starting with a letter or digit, got {value!r}")
    return value


def json_nesting(text: str | bytes) -> int:
    """How deep arrays and objects nest in ``text`` (JSON), found without parsing it."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    brackets = np.frombuffer(_JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    if not len(brackets):
        return 0
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def loads_json(text: str | bytes, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse untrusted JSON; BadRequest (400) if it is malformed or nested deeper than ``max_depth``."""
    if json_nesting(text) > max_depth:
        raise BadRequest(f"{what} nests arrays/objects deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc}") from None


def parse_header_json(raw: str | None, header: str) -> dict[str, Any]:
    if raw is None:
        raise BadRequest(f"missing header {header} (JSON metadata for this request)")
    value = loads_json(raw, f"header {header}")
    if not isinstance(value, dict):
        raise BadRequest(f"header {header} must be a JSON object, got {type(value).__name__}")
    return value


def parse_json_flag(text: str, flag: str) -> dict[str, Any]:
    """A command-line flag holding a JSON object; ValueError naming the flag otherwise."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")
    return value


def _require(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise BadRequest(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BadRequest(f"{where}: field {key!r} must be {names}, got {value!r}")
    return value


@dataclass(frozen=True)
class LoraSpec:
    """The adapter's shape; every worker of an expert must use the same one."""

    rank: int
    """LoRA rank r >= 1 (a full-parameter expert has no LoraSpec: see ExpertSpec.kind)."""
    alpha: float
    """LoRA alpha; the update applied to a weight is B @ A * alpha / rank."""
    target_modules: tuple[str, ...]
    """Module names LoRA is attached to, e.g. ("q_proj", "v_proj")."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_json(cls, obj: Any) -> "LoraSpec":
        if not isinstance(obj, dict):
            raise BadRequest(f"lora must be an object, got {obj!r}")
        rank = _require(obj, "rank", int, "lora")
        alpha = _require(obj, "alpha", (int, float), "lora")
        modules = _require(obj, "target_modules", list, "lora")
        if rank < 1:
            raise BadRequest(f"lora: rank must be >= 1, got {rank} (a full-parameter expert is "
                             '{"kind": "full", "full": {"num_parameters": N}} with no "lora")')
        if not is_finite_number(alpha) or alpha <= 0:
            raise BadRequest(f"lora: alpha must be a positive number, got {alpha!r}")
        if not modules or not all(isinstance(m, str) and m for m in modules):
            raise BadRequest(f"lora: target_modules must be a non-empty list of names, got {modules!r}")
        return cls(rank=rank, alpha=float(alpha), target_modules=tuple(sorted(set(modules))))

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules)}


@dataclass(frozen=True)
class BaseModelSpec:
    """Which base model an adapter belongs to: an id for people, a fingerprint for checks."""

    id: str
    fingerprint: str

    @classmethod
    def from_json(cls, obj: Any) -> "BaseModelSpec":
        if not isinstance(obj, dict):
            raise BadRequest(f"base_model must be an object, got {obj!r}")
        model_id = _require(obj, "id", str, "base_model")
        fingerprint = _require(obj, "fingerprint", str, "base_model")
        if not model_id or len(model_id) > 256:
            raise BadRequest(f"base_model: id must be 1-256 characters, got {model_id!r}")
        if not re.fullmatch(r"[0-9a-f]{16,128}", fingerprint):
            raise BadRequest(f"base_model: fingerprint must be lowercase hex, got {fingerprint!r}")
        return cls(id=model_id, fingerprint=fingerprint)


@dataclass(frozen=True)
class FullSpec:
    """A full-parameter expert: its tensors are the whole model's weights, not an adapter."""

    num_parameters: int
    """Values over all tensors; the initial weights must hold exactly this many."""

    @classmethod
    def from_json(cls, obj: Any) -> "FullSpec":
        if not isinstance(obj, dict):
            raise BadRequest(f"full must be an object, got {obj!r}")
        count = _require(obj, "num_parameters", int, "full")
        if count < 1:
            raise BadRequest(f"full: num_parameters must be >= 1, got {count}")
        return cls(num_parameters=count)


EXPERT_KINDS = ("lora", "full")


@dataclass(frozen=True)
class ExpertSpec:
    """What the first worker of a specialty sends to create the expert.

    Two kinds, never mixed: ``lora`` (the expert is an adapter: ``lora`` is set, ``full`` is
    None) and ``full`` (the expert is every weight of the model: ``full`` is set, ``lora`` None).
    """

    lora: LoraSpec | None
    base_model: BaseModelSpec
    worker_id: str | None = None
    full: FullSpec | None = None

    def __post_init__(self) -> None:
        if (self.lora is None) == (self.full is None):
            raise ValueError("an ExpertSpec has exactly one of lora (a LoRA expert) and full (a full one)")

    @property
    def kind(self) -> str:
        return "full" if self.full is not None else "lora"

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "ExpertSpec":
        worker_id = obj.get("worker_id")
        if worker_id is not None:
            check_name(worker_id, "worker_id")
        kind = obj.get("kind", "lora")
        if kind not in EXPERT_KINDS:
            raise BadRequest(f"kind must be one of {list(EXPERT_KINDS)}, got {kind!r}")
        base_model = BaseModelSpec.from_json(obj.get("base_model"))
        if kind == "full":
            if obj.get("lora") is not None:
                raise BadRequest('a full-parameter expert (kind "full") takes no "lora" settings')
            return cls(lora=None, full=FullSpec.from_json(obj.get("full")), base_model=base_model,
                       worker_id=worker_id)
        if obj.get("full") is not None:
            raise BadRequest('a LoRA expert takes no "full" settings; set "kind": "full" for a full-parameter one')
        return cls(lora=LoraSpec.from_json(obj.get("lora")), base_model=base_model, worker_id=worker_id)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "lora": None if self.lora is None else self.lora.to_json(),
                               "base_model": asdict(self.base_model), "worker_id": self.worker_id}
        if self.full is not None:
            out["full"] = asdict(self.full)
        return out


@dataclass(frozen=True)
class UpdateMeta:
    """Metadata of one pushed update (the delta itself is the request body)."""

    update_id: str
    """Unique per update; a retried push reuses it so it is applied once."""
    base_version: int
    """Expert version the worker started from; staleness = current - base_version."""
    num_samples: int
    """Training examples behind this update (weights buffered aggregation)."""
    train_loss: float | None = None
    codec: str = RAW_CODEC
    codec_config: dict[str, Any] = field(default_factory=dict)
    worker_id: str | None = None
    members: dict[str, str] | None = None
    """A relay's combined update only: the worker update ids it carries, each with the content id of the body
    the relay received. The root records them with the batch and refuses (409) a batch naming one it has seen."""
    privacy: dict[str, Any] | None = None
    """A worker training with --dp-sgd: the (epsilon, delta) its training data has spent so far (PRIVACY_FIELDS)."""
    dp_cohort: DPCohortSum | None = None
    """A relay's batch that is one DP cohort's unmasked sum (protocol/dp_cohort.py); it carries ``members`` too."""

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "UpdateMeta":
        where = "update metadata"
        update_id = _require(obj, "update_id", str, where)
        if not UPDATE_ID_RE.fullmatch(update_id):
            raise BadRequest(f"{where}: update_id must be 1-128 characters of letters, digits, "
                             f"'_', '.', ':', '-', got {update_id!r}")
        base_version = _require(obj, "base_version", int, where)
        num_samples = _require(obj, "num_samples", int, where)
        if not 0 <= base_version <= MAX_COUNT:
            raise BadRequest(f"{where}: base_version must be in [0, {MAX_COUNT}], got {base_version}")
        if not 0 <= num_samples <= MAX_COUNT:
            raise BadRequest(f"{where}: num_samples must be in [0, {MAX_COUNT}], got {num_samples}")
        loss = obj.get("train_loss")
        if loss is not None and not is_finite_number(loss):
            raise BadRequest(f"{where}: train_loss must be a finite number or null, got {loss!r}")
        codec = obj.get("codec", RAW_CODEC)
        if not isinstance(codec, str) or not codec:
            raise BadRequest(f"{where}: codec must be a non-empty string, got {codec!r}")
        config = obj.get("codec_config") or {}
        if not isinstance(config, dict):
            raise BadRequest(f"{where}: codec_config must be an object, got {config!r}")
        worker_id = obj.get("worker_id")
        if worker_id is not None:
            check_name(worker_id, "worker_id")
        members = obj.get("members")
        if members is not None:
            _check_members(members, update_id, where)
        privacy = obj.get("privacy")
        dp_cohort = obj.get("dp_cohort")
        if dp_cohort is not None and members is None:
            raise BadRequest(f"{where}: dp_cohort is a relay batch's field and comes with its members")
        return cls(update_id=update_id, base_version=base_version, num_samples=num_samples,
                   train_loss=None if loss is None else float(loss), codec=codec,
                   codec_config=config, worker_id=worker_id, members=members,
                   privacy=None if privacy is None else parse_privacy_claim(privacy, where),
                   dp_cohort=None if dp_cohort is None else DPCohortSum.from_json(dp_cohort, where))

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for optional in ("members", "privacy", "dp_cohort"):  # absent unless used: stored metadata stays as it was
            if out[optional] is None:
                del out[optional]
        return out


PRIVACY_FIELDS = {"epsilon": "a number >= 0", "delta": "a number in (0, 1)", "steps": "an integer >= 0",
                  "noise_multiplier": "a number > 0", "max_grad_norm": "a number > 0",
                  "sample_rate": "a number in (0, 1]", "mechanism": "dp-sgd", "accountant": "rdp or prv",
                  "budget": "null"}
"""What a worker's DP-SGD claim may carry (worker.dp_sgd.DPSGDTrainer.privacy_spent); other keys are refused."""
_PRIVACY_CHECKS: dict[str, Any] = {
    "epsilon": lambda v: is_finite_number(v) and v >= 0, "delta": lambda v: is_finite_number(v) and 0 < v < 1,
    "steps": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT,
    "noise_multiplier": lambda v: is_finite_number(v) and v > 0, "max_grad_norm": lambda v: is_finite_number(v) and v > 0,
    "sample_rate": lambda v: is_finite_number(v) and 0 < v <= 1, "mechanism": lambda v: v == "dp-sgd",
    "accountant": lambda v: v in ("rdp", "prv"), "budget": lambda v: v is None}


def parse_privacy_claim(obj: object, where: str) -> dict[str, Any]:
    """A worker's DP-SGD claim, checked field by field; BadRequest naming the field otherwise.

    It is the worker's own statement about its training: the coordinator records and shows it, it cannot verify it.
    """
    if not isinstance(obj, dict):
        raise BadRequest(f"{where}: privacy must be an object, got {str(obj)[:80]!r}")
    for key in ("mechanism", "epsilon", "delta"):
        if key not in obj:
            raise BadRequest(f"{where}: privacy: missing field {key!r}")
    for key, value in obj.items():
        check = _PRIVACY_CHECKS.get(key)
        if check is None:
            raise BadRequest(f"{where}: privacy: unknown field {str(key)[:40]!r}; known: {', '.join(PRIVACY_FIELDS)}")
        if not check(value):
            raise BadRequest(f"{where}: privacy: {key} must be {PRIVACY_FIELDS[key]}, got {str(value)[:40]!r}")
    return dict(obj)


def _check_members(members: object, update_id: str, where: str) -> None:
    if not isinstance(members, dict) or not 1 <= len(members) <= MAX_BATCH_MEMBERS:
        raise BadRequest(f"{where}: members must be an object of 1-{MAX_BATCH_MEMBERS} update ids, got "
                         f"{str(members)[:80]!r}")
    for member, digest in members.items():
        if not UPDATE_ID_RE.fullmatch(member) or member == update_id:
            raise BadRequest(f"{where}: members: {member[:140]!r} is not a valid update id other than the batch's own")
        if not isinstance(digest, str) or not is_content_id(digest):
            raise BadRequest(f"{where}: members[{member!r}] must be the content id of its body, got "
                             f"{str(digest)[:80]!r}")
