"""A relay's settings (``run_coordinator.py --upstream ...``): what it forwards to, and how."""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from coordinator.config import CoordinatorConfig
from coordinator.relay.forwarder import ForwardPolicy
from coordinator.relay.upstream import DiffPulls
from protocol.schemas import BaseModelSpec, check_name


@dataclass(frozen=True)
class RelayConfig:
    upstream: str
    """URL of the root coordinator this relay forwards to."""
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    """Data dir, tokens, body limit and staleness decay, as for the root."""
    join_token: str | None = None
    """The root's join token: the relay's workers join the relay with it (as they would the root)."""
    relay_join_token: str | None = None
    """The root's relay join token: the relay registers at the root with it (else with ``join_token``, which the
    root refuses unless it is the admin's)."""
    relay_id: str | None = None
    """Name of this relay at the root (default: host name and port)."""
    advertise_url: str | None = None
    """URL workers reach this relay at, published by the root at /api/v1/relays (None: not published)."""
    forward: ForwardPolicy = field(default_factory=ForwardPolicy)
    max_queue_mb: float = 1024.0
    """Bytes of updates held for forwarding at most (MiB); a push beyond it is a 507."""
    base_model_fingerprint: str | None = None
    """Pin the base model: the root and workers with another fingerprint are refused."""
    revalidate_seconds: float = 1.0
    """A worker's pull revalidates the cached weights upstream at most this often per expert."""
    upstream_diffs: DiffPulls | None = None
    """Fetch new versions as compressed diffs since the cached one (None: full weights, byte for byte the root's)."""
    site_model: bool = False
    """Serve the root's weights plus the site's updates not yet in them, each weighted by ``coordinator``'s
    async_alpha (auto: 1 / the site's workers of the expert); forward their weighted sum (coordinator/relay/site.py)."""

    def __post_init__(self) -> None:
        if not self.upstream.startswith(("http://", "https://")):
            raise ValueError(f"--upstream must be an http(s):// URL of the root coordinator, got {self.upstream!r}")
        try:  # "http://[::1" or a port out of range: was a connection attempt, then "InvalidURL (gave up...)"
            parts = urlsplit(self.upstream)
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError as exc:
            raise ValueError(f"--upstream {self.upstream!r} is not a valid URL ({exc})") from None
        if not parts.hostname:
            raise ValueError(f"--upstream must name a host, got {self.upstream!r}")
        if not 0.05 <= self.forward.interval <= 86400:
            raise ValueError(f"--forward-interval must be 0.05-86400 seconds, got {self.forward.interval}")
        if not self.max_queue_mb > 0:
            raise ValueError(f"--max-queue-mb must be > 0, got {self.max_queue_mb}")
        if self.relay_id is not None:
            try:
                check_name(self.relay_id, "--relay-id")
            except Exception as exc:  # noqa: BLE001 - a BadRequest here is a flag error
                raise ValueError(str(exc)) from None
        if self.base_model_fingerprint is not None:
            try:
                BaseModelSpec.from_json({"id": "relay", "fingerprint": self.base_model_fingerprint})
            except Exception:  # noqa: BLE001
                raise ValueError("--base-model-fingerprint must be the lowercase hex fingerprint a worker logs, got "
                                 f"{self.base_model_fingerprint!r}") from None
