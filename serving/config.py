"""The serving limits and knobs, validated once where the command line is read.

Each field is a serve.py flag with its help (protocol.cli.option), so flag, default and help are declared once.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protocol.cli import option


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; anything beyond gets a 400 before it reaches the model."""

    max_tokens: int = option(256, "largest max_tokens a request may ask for (also the default when it asks for none)")
    max_prompt_tokens: int = option(1024, "longest prompt in tokens, after the chat template")
    max_body_bytes: int = option(1 << 20, "largest request body; larger ones get a 413")
    timeout: float = option(120.0, "seconds a request may take, queueing included; one still generating then ends "
                                   "with finish_reason 'length'")
    max_queue: int = option(64, "requests waiting for the model at once before 429s (with Retry-After)")

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_prompt_tokens", "max_body_bytes", "max_queue"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not 0 < self.timeout < 86400:
            raise ValueError(f"--timeout must be a positive number of seconds, got {self.timeout!r}")


@dataclass(frozen=True)
class EngineOptions:
    """How the single generation thread batches requests."""

    max_batch: int = option(16, "rows generated together, any mix of experts; requests join and leave the running "
                                "batch between decode steps (1 = one request at a time)")
    batch_wait: float = option(0.005, "seconds an idle engine waits for more requests to prefill together once one "
                                      "has arrived")

    def __post_init__(self) -> None:
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"--max-batch must be a positive integer, got {self.max_batch!r}")
        if not 0 <= self.batch_wait <= 1:
            raise ValueError(f"--batch-wait must be in [0, 1] seconds, got {self.batch_wait!r}")


LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    base_model: str | None = None
    """Base model to load; None: the one the experts were trained from."""
    use_huggingface: bool = False
    poll_interval: float = 10.0
    """Seconds between two polls of the coordinator."""
    api_key_file: Path | None = None
    """Accepted API keys, one per line; None: no authentication (loopback only)."""
    route_threshold: float | None = None
    socket_timeout: float = 60.0
    """Seconds a connection may stall mid-request before it is dropped."""
    limits: Limits = Limits()
    engine: EngineOptions = EngineOptions()

    def __post_init__(self) -> None:
        if not 0.05 <= self.poll_interval <= 86400:
            raise ValueError(f"--poll-interval must be between 0.05 and 86400 seconds, got {self.poll_interval}")
        if self.api_key_file is None and self.host not in LOOPBACK:
            raise ValueError(f"--no-auth is only allowed with a loopback --host (127.0.0.1), not {self.host!r}")
        if self.route_threshold is not None and not 0 <= self.route_threshold <= 1:
            raise ValueError(f"--route-threshold must be in [0, 1], got {self.route_threshold}")
