"""Coordinator settings, validated once when built (the CLI and tests build them)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.aggregation import AGGREGATORS, ROBUST_RULES
from coordinator.aggregation.robust import trim_count
from coordinator.audit import NORMS_KEPT
from coordinator.norm_check import NORM_CHECK_MODES, NormPolicy
from gateway.errors import MergeError
from gateway.merges import MERGES, check_settings
from gateway.router import DEFAULT_THRESHOLD


@dataclass(frozen=True)
class CoordinatorConfig:
    data_dir: Path = Path("fedmoe-data")
    """Where blobs and the SQLite manifest live; restart on it to resume."""
    aggregation: str = "fedasync"
    """Aggregation rule: fedasync (apply each update) or fedbuff (buffer K)."""
    server_lr: float = 1.0
    """Global step size on aggregated deltas."""
    staleness_decay: float = 0.1
    """Stale updates weigh 1 / (1 + staleness_decay * staleness)."""
    buffer_size: int = 3
    """K, the number of updates fedbuff waits for before one aggregated step."""
    keep_versions: int = 20
    """Weights of the newest N versions of each expert stay downloadable."""
    gateway_weights: Mapping[str, float] | None = None
    """Per-expert gateway weights; None = proportional to samples each expert saw."""
    gateway_strategy: str = "weighted_average"
    """Merge used for the gateway model."""
    gateway_config: Mapping[str, Any] = field(default_factory=dict)
    """Settings of gateway_strategy (gateway.merges.SETTINGS), e.g. {"density": 0.2} for ties."""
    gateway_interval: float = 30.0
    """Seconds between gateway builds at most; changes in between coalesce into the next build."""
    keep_gateways: int = 2
    """Newest built gateways kept (rows and blobs); older ones are deleted."""
    route_threshold: float = DEFAULT_THRESHOLD
    """Router confidence below which a prompt goes to the gateway instead of one expert."""
    max_body_mb: float = 1024.0
    """Largest request body accepted, in MiB (413 above it)."""
    auth: bool = True
    """Require tokens (README, "Security"); off only on a trusted lab network (--no-auth)."""
    admin_token_file: Path | None = None
    """File holding the admin token; None = <data_dir>/admin_token, made on first start."""
    token_ttl_hours: float = 168.0
    """Worker tokens expire after this long; workers renew them by registering again."""
    rate_limit: float = 600.0
    """Requests per minute one worker may make (a bucket of as many); 0 = no limit."""
    manifest: str | None = None
    """postgresql://... keeps the manifest in PostgreSQL (replicas); None = SQLite in data_dir."""
    blobs: str | None = None
    """s3://bucket/prefix keeps blobs in an S3-compatible store (replicas); None = files in data_dir."""
    redirect_pulls_mb: float = 1.0
    """With --blobs s3://: weight pulls at least this large (MiB) are redirected to a presigned URL."""
    norm_check: str = "off"
    """off, reject (422) or clip updates whose norm is over norm_factor x the recent median."""
    norm_factor: float = 10.0
    """The norm limit, as a multiple of the median of the expert's recent accepted update norms."""
    norm_history: int = 20
    """Accepted update norms (newest) the median is taken over."""
    norm_warmup: int = 5
    """Accepted updates before the norm check applies."""
    robust: str = "none"
    """Robust combination of a fedbuff buffer: none (weighted mean), clip, median or trimmed_mean."""
    trim_fraction: float = 0.2
    """trimmed_mean drops floor(trim_fraction x buffer size) values at each end of every coordinate."""
    extra: Mapping[str, object] = field(default_factory=dict)
    """Flask config overrides (tests)."""

    def __post_init__(self) -> None:
        # Absolute once, here: Flask's send_file resolves a relative path against the package
        # folder, not the working directory (every download answered 500 with the default).
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser().absolute())
        if self.manifest is not None and not self.manifest.startswith(("postgresql://", "postgres://")):
            raise ValueError(f"--manifest must be a postgresql://user@host:port/db URL, got {self.manifest!r}")
        if self.blobs is not None and not self.blobs.startswith("s3://"):
            raise ValueError(f"--blobs must be an s3://bucket/prefix URL, got {self.blobs!r}")
        if self.gateway_strategy not in MERGES:
            raise ValueError(f"--gateway-strategy must be one of {sorted(MERGES)}, got {self.gateway_strategy!r}")
        try:
            check_settings(self.gateway_strategy, dict(self.gateway_config))
        except MergeError as exc:
            raise ValueError(f"--gateway-config: {exc}") from None
        if not 0 <= self.gateway_interval <= 86400:
            raise ValueError(f"--gateway-interval must be 0-86400 seconds, got {self.gateway_interval}")
        if self.keep_gateways < 1:
            raise ValueError(f"--keep-gateways must be >= 1, got {self.keep_gateways}")
        if self.aggregation not in AGGREGATORS:
            raise ValueError(f"--aggregation must be one of {sorted(AGGREGATORS)}, got {self.aggregation!r}")
        if not self.server_lr > 0:
            raise ValueError(f"--server-lr must be > 0, got {self.server_lr}")
        if not self.staleness_decay >= 0:
            raise ValueError(f"--staleness-decay must be >= 0, got {self.staleness_decay}")
        if self.buffer_size < 1:
            raise ValueError(f"--buffer-size must be >= 1, got {self.buffer_size}")
        if self.keep_versions < 1:
            raise ValueError(f"--keep-versions must be >= 1, got {self.keep_versions}")
        if not 0 <= self.route_threshold <= 1:
            raise ValueError(f"--route-threshold must be in [0, 1], got {self.route_threshold}")
        if not self.max_body_mb > 0:
            raise ValueError(f"--max-body-mb must be > 0, got {self.max_body_mb}")
        if self.admin_token_file is not None:
            object.__setattr__(self, "admin_token_file", Path(self.admin_token_file).expanduser().absolute())
        if not self.token_ttl_hours > 0:
            raise ValueError(f"--token-ttl-hours must be > 0, got {self.token_ttl_hours}")
        if not self.rate_limit >= 0:
            raise ValueError(f"--rate-limit must be >= 0 requests per minute (0 = no limit), got {self.rate_limit}")
        self._check_robustness()
        for name, weight in (self.gateway_weights or {}).items():
            if not weight >= 0:
                raise ValueError(f"--gateway-weights: weight of {name!r} must be >= 0, got {weight}")

    def _check_robustness(self) -> None:
        if self.norm_check not in NORM_CHECK_MODES:
            raise ValueError(f"--norm-check must be one of {list(NORM_CHECK_MODES)}, got {self.norm_check!r}")
        if not self.norm_factor > 1:
            raise ValueError(f"--norm-factor must be > 1, got {self.norm_factor}")
        if not 1 <= self.norm_history <= NORMS_KEPT:
            raise ValueError(f"--norm-history must be 1-{NORMS_KEPT}, got {self.norm_history}")
        if not 1 <= self.norm_warmup <= self.norm_history:
            raise ValueError(f"--norm-warmup must be 1-{self.norm_history} (--norm-history), got {self.norm_warmup}")
        if self.robust != "none" and self.robust not in ROBUST_RULES:
            raise ValueError(f"--robust must be one of {['none', *sorted(ROBUST_RULES)]}, got {self.robust!r}")
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"--trim-fraction must be in [0, 0.5), got {self.trim_fraction}")
        if self.robust == "none":
            return
        if self.aggregation != "fedbuff" or self.buffer_size < 3:
            raise ValueError(f"--robust {self.robust} combines a buffer of updates: it needs --aggregation fedbuff "
                             f"and --buffer-size >= 3, got --aggregation {self.aggregation} "
                             f"--buffer-size {self.buffer_size}")
        if self.robust == "trimmed_mean" and trim_count(self.buffer_size, self.trim_fraction) < 1:
            raise ValueError(f"--trim-fraction {self.trim_fraction} trims nothing from a buffer of "
                             f"{self.buffer_size} updates; use at least {math.ceil(1000 / self.buffer_size) / 1000:g}")

    @property
    def norm_policy(self) -> NormPolicy:
        return NormPolicy(self.norm_check, self.norm_factor, self.norm_history, self.norm_warmup)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))

    @property
    def updates_per_step(self) -> int:
        return self.buffer_size if self.aggregation == "fedbuff" else 1


def parse_gateway_weights(text: str) -> dict[str, float]:
    """Parse ``python_expert=2,sql_expert=1`` into a dict, with an error naming the bad part."""
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            if not sep or not name.strip():
                raise ValueError
            weights[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"expected NAME=WEIGHT pairs separated by commas, got {part!r}") from None
    if not weights:
        raise ValueError(f"expected NAME=WEIGHT pairs separated by commas, got {text!r}")
    return weights
