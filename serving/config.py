"""The serving limits and knobs, validated once where the command line is read."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; anything beyond gets a 400 before it reaches the model."""

    max_tokens: int = 256
    """Largest max_tokens a request may ask for (also the default when it asks for none)."""
    max_prompt_tokens: int = 1024
    """Longest prompt, in tokens, after the chat template."""
    max_body_bytes: int = 1 << 20
    """Largest request body; larger ones get a 413."""
    timeout: float = 120.0
    """Seconds from arrival to the last token; a request still generating then ends with finish_reason 'length'."""
    max_queue: int = 64
    """Requests waiting for the model at once; more get a 429 with Retry-After."""

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_prompt_tokens", "max_body_bytes", "max_queue"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not 0 < self.timeout < 86400:
            raise ValueError(f"--timeout must be a positive number of seconds, got {self.timeout!r}")


@dataclass(frozen=True)
class EngineOptions:
    """How the single generation thread groups requests."""

    max_batch: int = 8
    """Requests generated together in one batch (1 = one request at a time)."""
    batch_wait: float = 0.005
    """Seconds the engine waits for more requests to join a batch once one has arrived."""
    mix_adapters: bool = True
    """Rows of different adapters in one generate call (PEFT adapter_names); False: one call per adapter."""

    def __post_init__(self) -> None:
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"--max-batch must be a positive integer, got {self.max_batch!r}")
        if not 0 <= self.batch_wait <= 1:
            raise ValueError(f"--batch-wait must be in [0, 1] seconds, got {self.batch_wait!r}")
