"""How the worker turns a delta into the bytes of one update: raw safetensors or a compression codec.

With a lossy codec the encoder keeps an error-feedback residual, so what one
sync drops is sent in a later one instead of being lost. The residual is training
the coordinator does not have yet: the worker keeps it in its local weights
(``worker.federation``: local = pulled + residual) and the last update of a run is
a *flush*, sent losslessly as fp32 safetensors with the residual added, so nothing
trained stays behind when the worker exits.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from compression import ErrorFeedback, make_codec, measure
from compression.wire import decode_update, encode_update
from protocol.schemas import RAW_CODEC
from protocol.tensors import Manifest, StateDict, dumps, loads


@dataclass(frozen=True)
class CompressionSettings:
    codec: str = RAW_CODEC
    """'safetensors' (uncompressed) or a compression spec such as 'int8' or 'topk+int8'."""
    config: dict[str, Any] = field(default_factory=dict)
    """Codec options, e.g. {"ratio": 0.01}; sent to the coordinator with each update."""
    error_feedback: bool = True
    """Carry what a lossy codec dropped into the next update."""
    decay: float = 1.0
    """Residual decay in [0, 1] (1 = keep everything)."""

    def __post_init__(self) -> None:
        if self.codec != RAW_CODEC:
            make_codec(self.codec, self.config)  # raises CompressionError listing valid names/keys


@dataclass(frozen=True)
class PullSettings:
    codec: str | None = None
    """Codec for pulling only the difference since our version (e.g. 'fp16', 'int8'); None = full weights."""
    config: dict[str, Any] = field(default_factory=dict)
    full_every: int = 10
    """Every N-th pull fetches the full weights, so lossy diff pulls cannot drift far."""

    def __post_init__(self) -> None:
        if self.codec is not None:
            make_codec(self.codec, self.config)
        if self.full_every < 1:
            raise ValueError(f"--full-pull-every must be >= 1, got {self.full_every}")

    def decoder(self):
        return make_codec(self.codec, self.config) if self.codec else None


@dataclass(frozen=True)
class EncodedUpdate:
    body: bytes
    sent: StateDict
    """What the coordinator will decode from ``body``."""
    metrics: dict[str, Any]
    codec_meta: dict[str, Any] = field(default_factory=lambda: {"codec": RAW_CODEC, "codec_config": {}})
    """The update's codec and options, for its metadata (a flush is raw whatever the settings)."""


class UpdateEncoder:
    def __init__(self, settings: CompressionSettings) -> None:
        self.settings = settings
        self._codec = None if settings.codec == RAW_CODEC else make_codec(settings.codec, settings.config)
        self._feedback = (ErrorFeedback(self._codec, settings.decay)
                          if self._codec is not None and settings.error_feedback else None)
        self._pending: StateDict = {}
        """A residual from a checkpoint this encoder keeps none of (another codec): added to the next update."""

    @property
    def codec_meta(self) -> dict[str, Any]:
        return {"codec": self.settings.codec, "codec_config": dict(self.settings.config)}

    @property
    def lossy(self) -> bool:
        return self._codec is not None

    def encode(self, delta: StateDict, manifest: Manifest, seed: int, flush: bool = False) -> EncodedUpdate:
        """Encode ``delta`` (plus the carried residual); metrics compare it with what will be decoded.

        ``flush``: send delta + residual exactly (fp32 safetensors) and carry nothing on; the last
        update of a run, so the coordinator ends with everything this worker trained.
        ``encode_ms`` covers encoding (and, with error feedback, the residual update);
        ``decode_ms`` is a separate timing of what the coordinator will do with the body.
        """
        carried = self.carried()
        target = {k: v + carried[k] for k, v in delta.items()} if carried else delta  # what this update carries
        started = time.perf_counter()
        if self._codec is None or flush:
            body, codec = dumps(target), None
            self._forget_carried()
        elif self._feedback is not None:
            body, _ = self._feedback.compress(delta, manifest, seed)
            codec = self._codec
        else:
            body, codec = encode_update(target, manifest, self._codec, seed), self._codec
            self._forget_carried()
        encode_ms = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        sent = loads(body) if codec is None else decode_update(body, manifest, codec)
        decode_ms = (time.perf_counter() - started) * 1000
        metrics = measure(target, sent, body, encode_ms, decode_ms, codec=codec,
                          manifest=manifest if codec is not None else None)
        metrics["residual_norm"] = self.residual_norm()
        if flush and self.lossy:
            metrics["flushed_residual_norm"] = _norm(carried)
        meta = self.codec_meta if codec is not None else {"codec": RAW_CODEC, "codec_config": {}}
        return EncodedUpdate(body, sent, metrics, meta)

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


def _norm(tensors: StateDict) -> float:
    return float(sum(float(t.double().pow(2).sum()) for t in tensors.values()) ** 0.5)
