"""How the worker turns a delta into the bytes of one update: raw safetensors or a compression codec.

With a lossy codec the encoder keeps an error-feedback residual, so what one
sync drops is sent in a later one instead of being lost. The residual is training
the coordinator does not have yet: the worker keeps it in its local weights
(``worker.federation``: local = pulled + residual) and the last update of a run is
a *flush*, sent losslessly as fp32 safetensors with the residual added, so nothing
trained stays behind when the worker exits.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from compression import Codec, ErrorFeedback, make_codec, measure
from compression.error_feedback import Compressed
from compression.wire import decode_update, encode_update
from protocol.schemas import RAW_CODEC
from protocol.tensors import Manifest, StateDict, dumps, loads
from worker.choices import AUTO_CODEC, DEFAULT_CODEC, DEFAULT_PULL_CODEC, check_sync_budget, default_pull_codec


@dataclass(frozen=True)
class CodecChoice:
    """One update's codec: a spec such as 'int8' or 'topk+int8' with its options, or 'safetensors' (exact)."""

    codec: str
    config: dict[str, Any] = field(default_factory=dict)
    error_feedback: bool = True
    """False: this update carries delta + residual through the codec and leaves no residual, even when
    the encoder keeps error feedback (--compression auto's random-k rung, an unbiased estimate)."""

    @property
    def meta(self) -> dict[str, Any]:
        """The update metadata's codec fields."""
        return {"codec": self.codec, "codec_config": dict(self.config)}


RAW = CodecChoice(RAW_CODEC)


@dataclass(frozen=True)
class CompressionSettings:
    codec: str = DEFAULT_CODEC
    """A compression spec such as 'int8' (the default) or 'topk+int8', 'safetensors' (lossless), or 'auto'."""
    config: dict[str, Any] = field(default_factory=dict)
    """Codec options, e.g. {"ratio": 0.01}; sent to the coordinator with each update."""
    error_feedback: bool = True
    """Carry what a lossy codec dropped into the next update."""
    decay: float = 1.0
    """Residual decay in [0, 1] (1 = keep everything)."""
    sync_budget: float | None = None
    """With codec 'auto': seconds a push (and a pull) may take; the codec is picked per sync to fit it."""

    def __post_init__(self) -> None:
        if self.codec == AUTO_CODEC and self.config:
            raise ValueError("--compression-config does not apply to --compression auto (it picks the codec and "
                             "ratio at each sync); drop it")
        check_sync_budget(self.codec, self.sync_budget)
        if self.codec not in (RAW_CODEC, AUTO_CODEC):
            make_codec(self.codec, self.config)  # raises CompressionError listing valid names/keys

    @property
    def adaptive(self) -> bool:
        return self.codec == AUTO_CODEC


@dataclass(frozen=True)
class PullSettings:
    codec: str | None = DEFAULT_PULL_CODEC
    """Codec for pulling only the difference since our version (e.g. 'int8', 'fp16'); None = full weights
    (and with --compression auto: full weights or a diff, picked at each sync)."""
    config: dict[str, Any] = field(default_factory=dict)
    full_every: int = 10
    """Every N-th pull fetches the full weights, so lossy diff pulls cannot drift far."""

    def __post_init__(self) -> None:
        if self.codec is not None:
            make_codec(self.codec, self.config)
        if self.full_every < 1:
            raise ValueError(f"--full-pull-every must be >= 1, got {self.full_every}")


def default_pull(push: CompressionSettings) -> PullSettings:
    """The pulls that go with ``push`` when none are asked for (worker.choices.default_pull_codec)."""
    return PullSettings(codec=default_pull_codec(push.codec))


@dataclass(frozen=True)
class EncodedUpdate:
    body: bytes
    sent: StateDict
    """What the coordinator will decode from ``body``."""
    metrics: dict[str, Any]
    codec_meta: dict[str, Any] = field(default_factory=lambda: {"codec": RAW_CODEC, "codec_config": {}})
    """The update's codec and options, for its metadata (a flush is raw whatever the settings)."""


class UpdateEncoder:
    """Encodes each sync's delta with the configured codec, or with the one ``encode`` is given (auto).

    The error-feedback residual is a tensor per weight, whatever codec produced it, so the codec may
    change from one update to the next: an exact (safetensors) update sends delta + residual and
    leaves nothing behind; a lossy one leaves what it dropped for the next.
    """

    def __init__(self, settings: CompressionSettings) -> None:
        self.settings = settings
        self._codecs: dict[str, Codec] = {}
        fixed = None if settings.codec in (RAW_CODEC, AUTO_CODEC) else self._codec(self.default_choice)
        self._feedback = ErrorFeedback(fixed, settings.decay) if self.lossy and settings.error_feedback else None
        self._pending: StateDict = {}
        """A residual from a checkpoint this encoder keeps none of (another codec): added to the next update."""

    @property
    def default_choice(self) -> CodecChoice:
        """The configured codec (for 'auto', the placeholder its checkpoints record)."""
        return CodecChoice(self.settings.codec, dict(self.settings.config))

    @property
    def codec_meta(self) -> dict[str, Any]:
        return self.default_choice.meta

    @property
    def lossy(self) -> bool:
        """Whether updates may leave a residual (a lossy codec, or auto, which picks one on slow links)."""
        return self.settings.codec != RAW_CODEC

    def _codec(self, choice: CodecChoice) -> Codec:
        key = f"{choice.codec} {json.dumps(choice.config, sort_keys=True)}"
        if key not in self._codecs:
            self._codecs[key] = make_codec(choice.codec, choice.config)
        return self._codecs[key]

    def encode(self, delta: StateDict, manifest: Manifest, seed: int, flush: bool = False,
               choice: CodecChoice | None = None) -> EncodedUpdate:
        """Encode ``delta`` (plus the carried residual); metrics compare it with what will be decoded.

        ``choice``: the codec of this update (auto); default the configured one.
        ``flush``: send delta + residual exactly (fp32 safetensors) and carry nothing on; the last
        update of a run, so the coordinator ends with everything this worker trained.
        ``encode_ms`` covers encoding, ``decode_ms`` decoding the body once, as the coordinator will
        (the decoded tensors are also what the residual is computed from).
        """
        choice = RAW if flush else choice or self.default_choice
        if choice.codec == AUTO_CODEC:
            raise ValueError("--compression auto: encode() needs the codec picked for this sync")
        carried = self.carried()
        target = {k: v + carried[k] for k, v in delta.items()} if carried else delta  # what this update carries
        if choice.codec == RAW_CODEC:
            codec, out = None, self._encode_raw(target)
            self._forget_carried()
        elif self._feedback is not None and choice.error_feedback:
            codec = self._codec(choice)
            out = self._feedback.compress(delta, manifest, seed, codec=codec)
        else:
            codec = self._codec(choice)
            out = _encode_lossy(target, manifest, codec, seed)
            self._forget_carried()
        metrics = _exact_metrics(target, out) if codec is None else \
            measure(target, out.decoded, out.payload, out.encode_ms, out.decode_ms, codec=codec, manifest=manifest)
        metrics["residual_norm"] = self.residual_norm()
        if flush and self.lossy:
            metrics["flushed_residual_norm"] = _norm(carried)
        return EncodedUpdate(out.payload, out.decoded, metrics, choice.meta)

    @staticmethod
    def _encode_raw(target: StateDict) -> Compressed:
        started = time.perf_counter()
        body = dumps(target)
        encoded = time.perf_counter()
        sent = loads(body)  # fp32 safetensors round-trips exactly; decoded to time what the coordinator does
        return Compressed(body, sent, (encoded - started) * 1000, (time.perf_counter() - encoded) * 1000)

    def carried(self) -> StateDict:
        """What the next update adds to its delta: the error-feedback residual (or one loaded from a checkpoint)."""
        return dict(self._feedback.residual if self._feedback is not None else self._pending)  # read only

    def _forget_carried(self) -> None:
        self._pending = {}
        if self._feedback is not None:
            self._feedback.reset()

    def reset(self) -> None:
        """Forget the carried residual (after a failed encode, or when weights were replaced)."""
        self._forget_carried()

    def residual_norm(self) -> float:
        return _norm(self.carried())

    def state_dict(self) -> StateDict:
        """The residual, copied (a checkpoint written while training goes on)."""
        return {k: v.detach().clone().contiguous() for k, v in self.carried().items()}

    def load_state_dict(self, state: StateDict) -> None:
        """Restore a residual; one this encoder would not carry (no error feedback) goes into the next update."""
        if self._feedback is not None:
            self._feedback.load_state_dict(state)
        else:
            ErrorFeedback.check_residual(state)
            self._pending = {k: v.detach().to(torch.float32).clone() for k, v in state.items()}


def _encode_lossy(target: StateDict, manifest: Manifest, codec: Codec, seed: int) -> Compressed:
    started = time.perf_counter()
    body = encode_update(target, manifest, codec, seed)
    encoded = time.perf_counter()
    sent = decode_update(body, manifest, codec)
    return Compressed(body, sent, (encoded - started) * 1000, (time.perf_counter() - encoded) * 1000)


def _exact_metrics(target: StateDict, out: Compressed) -> dict[str, Any]:
    """``measure``'s figures for an fp32 safetensors update, which decodes to exactly ``target``: no error, cosine 1.
    ``measure`` flattened both to float64 to find that out: 0.054 of a lossless sync's 0.077 CPU s of encoding on a
    smollm2-135m rank-8 update (~0.2 s of wall time per sync for a worker at a quarter core, docs/wan.md)."""
    numel = sum(t.numel() for t in target.values())
    sent = len(out.payload)
    nonzero = sum(int(torch.count_nonzero(t)) for t in target.values())
    return {"numel": numel, "bytes_raw": 4 * numel, "bytes_sent": sent, "ratio": 4 * numel / sent if sent else math.inf,
            "bits_per_param": 8 * sent / numel if numel else 0.0, "relative_error": 0.0, "cosine": 1.0,
            "encode_ms": float(out.encode_ms), "decode_ms": float(out.decode_ms),
            "density": nonzero / numel if numel else 1.0, "index_bytes": None, "framing_bytes": None}


def _norm(tensors: StateDict) -> float:
    return float(sum(float(t.double().pow(2).sum()) for t in tensors.values()) ** 0.5)
