"""How a worker turns a delta into bytes: plain safetensors or a compression codec.

With a lossy codec the encoder keeps an error-feedback residual, so what one
sync drops is sent in a later one instead of being lost.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

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


class UpdateEncoder:
    def __init__(self, settings: CompressionSettings) -> None:
        self.settings = settings
        self._codec = None if settings.codec == RAW_CODEC else make_codec(settings.codec, settings.config)
        self._feedback = (ErrorFeedback(self._codec, settings.decay)
                          if self._codec is not None and settings.error_feedback else None)

    @property
    def codec_meta(self) -> dict[str, Any]:
        return {"codec": self.settings.codec, "codec_config": dict(self.settings.config)}

    def encode(self, delta: StateDict, manifest: Manifest, seed: int) -> EncodedUpdate:
        """Encode ``delta`` (plus the carried residual); metrics compare it with what will be decoded.

        ``encode_ms`` covers encoding (and, with error feedback, the residual update);
        ``decode_ms`` is a separate timing of what the coordinator will do with the body.
        """
        target = delta  # what this update means to carry: the delta plus what earlier ones dropped
        started = time.perf_counter()
        if self._codec is None:
            body = dumps(delta)
        elif self._feedback is not None:
            carried = self._feedback.state_dict()
            target = {k: v + carried[k] for k, v in delta.items()} if carried else delta
            body, _ = self._feedback.compress(delta, manifest, seed)
        else:
            body = encode_update(delta, manifest, self._codec, seed)
        encode_ms = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        sent = loads(body) if self._codec is None else decode_update(body, manifest, self._codec)
        decode_ms = (time.perf_counter() - started) * 1000
        metrics = measure(target, sent, body, encode_ms, decode_ms, codec=self._codec,
                          manifest=manifest if self._codec is not None else None)
        metrics["residual_norm"] = self.residual_norm()
        return EncodedUpdate(body, sent, metrics)

    def reset(self) -> None:
        """Forget the carried residual (after a failed encode, or when weights were replaced)."""
        if self._feedback is not None:
            self._feedback.reset()

    def residual_norm(self) -> float:
        if self._feedback is None:
            return 0.0
        return float(sum(float(r.double().pow(2).sum()) for r in self._feedback.state_dict().values()) ** 0.5)

    def state_dict(self) -> StateDict:
        return self._feedback.state_dict() if self._feedback is not None else {}

    def load_state_dict(self, state: StateDict) -> None:
        if self._feedback is not None:
            self._feedback.load_state_dict(state)
