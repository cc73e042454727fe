"""Coordinator settings, validated once when built (the CLI and tests build them).

The fields carry their flag's help and default (protocol.cli.option): run_coordinator.py's flags are built
from CoordinatorConfig and ServeOptions, so a setting is declared once.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Light imports only: run_coordinator.py builds its flags from these dataclasses, and --help must not wait for
# torch (the registries behind the *choices modules import it; __post_init__ imports what it checks with).
from coordinator.choices import AGGREGATION_NAMES, ROBUST_NAMES
from coordinator.checks.norm_check import NORM_CHECK_MODES, NormPolicy
from gateway.choices import DEFAULT_ROUTE_THRESHOLD, MERGE_NAMES
from privacy.secagg.settings import GROUP as SECAGG, SecAggSettings
from protocol.cli import json_object, option

REPLICAS = "replicas (docs/scale.md)"
SECURITY = 'security (README, "Security")'
PRIVACY = "privacy (docs/privacy.md)"


@dataclass(frozen=True)
class CoordinatorConfig:
    """The coordinator's settings; each field with help is a run_coordinator.py flag (protocol.cli.option)."""

    data_dir: Path = option(Path("fedmoe-data"), "where experts are stored (blobs and the SQLite manifest); "
                            "restart on it to resume")
    aggregation: str = option("fedasync", "fedasync applies each update at once; fedbuff waits for --buffer-size",
                              choices=AGGREGATION_NAMES)
    server_lr: float = option(1.0, "step size on aggregated deltas")
    async_alpha: float | None = option(
        None, "fedasync's mixing weight alpha (Xie et al. 2019): each update is applied at alpha x server-lr / (1 + "
              "decay x staleness); 1 is the original tool's rule (default: auto = 1 / N for the N sources of the "
              "expert's updates: its workers here, alive or stale, and each relay forwarding it, so N sources' "
              "updates add up to their mean, not N times it; staleness up to N - 1 then counts as on time)",
        metavar="ALPHA|auto", parse=lambda text, flag: _async_alpha(text))
    staleness_decay: float = option(0.1, "updates weigh 1/(1 + decay * staleness), staleness = versions behind")
    buffer_size: int = option(3, "K updates per fedbuff step")
    keep_versions: int = option(20, "newest versions per expert kept downloadable")
    gateway_weights: Mapping[str, float] | None = option(
        None, "per-expert gateway weights (default: proportional to samples trained)", metavar="NAME=W,...",
        parse=lambda text, flag: _gateway_weights(text))
    gateway_strategy: str = option("weighted_average", "merge used for the gateway (weighted_average is exact)",
                                   choices=MERGE_NAMES)
    gateway_config: Mapping[str, Any] = option(
        help='settings of --gateway-strategy, e.g. \'{"density": 0.2}\' for ties, \'{"p": 0.5, "lam": 1.0}\' '
             "for dare; keys: density, p, seed, lam, rank by strategy (default: its defaults)",
        default_factory=dict, metavar="JSON", parse=json_object)
    gateway_interval: float = option(30.0, "seconds between gateway builds at most; expert changes in between "
                                           "coalesce into the next build")
    keep_gateways: int = option(2, "newest built gateways kept on disk (rows and blobs); older ones are deleted")
    route_threshold: float = option(DEFAULT_ROUTE_THRESHOLD, "router confidence below which prompts go to the "
                                                             "gateway instead of one expert")
    max_body_mb: float = option(1024.0, "largest accepted request body in MiB (413 above it)")
    upload_idle_seconds: float = option(300.0, "a resumable upload that receives no chunk for this long expires "
                                               "(one receiving chunks never does); its bytes are removed")
    auth: bool = option(True, "accept requests without tokens; only on a trusted lab network", flag="--no-auth",
                        group=SECURITY)
    admin_token_file: Path | None = option(None, "file holding the admin token (default: <data-dir>/admin_token, "
                                                 "made on first start)", type=Path, group=SECURITY)
    token_ttl_hours: float = option(168.0, "worker tokens expire after this long; workers renew them",
                                    group=SECURITY)
    rate_limit: float = option(600.0, "requests per minute one worker may make, 0 = no limit", group=SECURITY)
    manifest: str | None = option(None, "postgresql://user@host:port/db keeps the manifest in PostgreSQL so several "
                                        "coordinator replicas share it (docs/scale.md; default: SQLite in --data-dir)",
                                  metavar="URL", group=REPLICAS)
    blobs: str | None = option(None, "s3://bucket/prefix keeps blobs in an S3-compatible store (endpoint and "
                                     "credentials from the AWS_* environment; default: files in --data-dir)",
                               metavar="URL", group=REPLICAS)
    redirect_pulls_mb: float = option(1.0, "with --blobs s3://, weight pulls at least this large (MiB) are "
                                           "redirected to a presigned URL", group=REPLICAS)
    norm_check: str = option("off", "reject (422) or clip updates whose L2 norm is over --norm-factor x the median "
                                    "of the expert's recent accepted norms", choices=NORM_CHECK_MODES)
    norm_factor: float = option(10.0, "norm limit multiple")
    norm_history: int = option(20, "recent accepted norms the median is taken over")
    norm_warmup: int = option(5, "accepted updates before the norm check applies")
    robust: str = option("none", "robust combination of each fedbuff buffer (none = weighted mean)",
                         choices=("none", *ROBUST_NAMES))
    trim_fraction: float = option(0.2, "share of values trimmed at each end by --robust trimmed_mean")
    dp_noise: float | None = option(None, "worker-level differential privacy (DP-FedAvg): each aggregation step "
                                          "clips every worker's update to --dp-clip and adds Gaussian noise of this "
                                          "multiple of --dp-clip (with --secure-aggregation the K workers of a "
                                          "cohort do it, each adding 1/K of the variance); the (epsilon, delta) "
                                          "spent is shown per expert",
                                    type=float, metavar="SIGMA", group=PRIVACY)
    dp_clip: float | None = option(None, "with --dp-noise: the L2 norm every worker's contribution to a step is "
                                         "clipped to", type=float, metavar="C", group=PRIVACY)
    dp_delta: float = option(1e-5, "with --dp-noise: the delta of the (epsilon, delta) reported; keep it well "
                                   "below 1 / number of workers", group=PRIVACY)
    dp_budget: float | None = option(None, "with --dp-noise: the epsilon an expert may spend; pushes that would "
                                           "need another step are then refused (409 privacy_budget_spent)",
                                     type=float, metavar="EPS", group=PRIVACY)
    secure_aggregation: bool = option(False, "learn only the sum of each cohort of --buffer-size workers' updates "
                                             "(pairwise masking, Bonawitz et al. 2017; needs --aggregation fedbuff); "
                                             "workers run with --secure-aggregation and a push in the clear is "
                                             "refused (docs/secure-aggregation.md)", group=SECAGG)
    secagg: SecAggSettings | None = None
    """The --secagg-* flags (run_coordinator.py builds them); None: their defaults, sized to --buffer-size."""
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
        from gateway.errors import MergeError
        from gateway.merges import check_settings

        if self.gateway_strategy not in MERGE_NAMES:
            raise ValueError(f"--gateway-strategy must be one of {list(MERGE_NAMES)}, got {self.gateway_strategy!r}")
        try:
            check_settings(self.gateway_strategy, dict(self.gateway_config))
        except MergeError as exc:
            raise ValueError(f"--gateway-config: {exc}") from None
        if not 0 <= self.gateway_interval <= 86400:
            raise ValueError(f"--gateway-interval must be 0-86400 seconds, got {self.gateway_interval}")
        if self.keep_gateways < 1:
            raise ValueError(f"--keep-gateways must be >= 1, got {self.keep_gateways}")
        if self.aggregation not in AGGREGATION_NAMES:
            raise ValueError(f"--aggregation must be one of {list(AGGREGATION_NAMES)}, got {self.aggregation!r}")
        if not self.server_lr > 0:
            raise ValueError(f"--server-lr must be > 0, got {self.server_lr}")
        if self.async_alpha is not None and not 0 < self.async_alpha <= 1:
            raise ValueError(f"--async-alpha must be in (0, 1] or auto, got {self.async_alpha}")
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
        if not 1 <= self.upload_idle_seconds <= 86400:
            raise ValueError(f"--upload-idle-seconds must be 1-86400, got {self.upload_idle_seconds}")
        if self.admin_token_file is not None:
            object.__setattr__(self, "admin_token_file", Path(self.admin_token_file).expanduser().absolute())
            if self.admin_token_file.is_dir():  # was "[Errno 21] Is a directory", after the data dir's recovery ran
                raise ValueError(f"--admin-token-file {str(self.admin_token_file)!r} is a directory; give a file "
                                 "(it is created with a new token if missing)")
        if not self.token_ttl_hours > 0:
            raise ValueError(f"--token-ttl-hours must be > 0, got {self.token_ttl_hours}")
        if not self.rate_limit >= 0:
            raise ValueError(f"--rate-limit must be >= 0 requests per minute (0 = no limit), got {self.rate_limit}")
        self._check_robustness()
        self._check_privacy()
        self._check_secure_aggregation()
        for name, weight in (self.gateway_weights or {}).items():
            if not weight >= 0:
                raise ValueError(f"--gateway-weights: weight of {name!r} must be >= 0, got {weight}")

    def _check_privacy(self) -> None:
        """--dp-* flags: all or nothing, and not with what would change a worker's influence on a step."""
        if self.dp_noise is None:
            given = [flag for flag, value in (("--dp-clip", self.dp_clip), ("--dp-budget", self.dp_budget))
                     if value is not None] + (["--dp-delta"] if self.dp_delta != 1e-5 else [])
            if given:
                raise ValueError(f"{', '.join(given)} need(s) --dp-noise SIGMA (worker-level differential privacy)")
            return
        if self.dp_clip is None:
            raise ValueError("--dp-noise needs --dp-clip C: the L2 norm each worker's update is clipped to")
        if self.robust != "none":
            raise ValueError(f"--dp-noise cannot be combined with --robust {self.robust}: its guarantee needs each "
                             "step to be the clipped mean plus noise")
        if self.manifest is not None:
            raise ValueError("--dp-noise keeps each expert's privacy ledger in --data-dir, which replicas sharing "
                             "--manifest do not share; run one coordinator for private experts")
        self.dp  # noqa: B018 - builds the settings, which check each value

    @property
    def dp(self) -> Any:
        """The DP-FedAvg settings (privacy.dp.DPFedAvgSettings), or None without --dp-noise."""
        if self.dp_noise is None or self.dp_clip is None:
            return None
        from privacy.dp import DPFedAvgSettings  # torch: not for --help

        return DPFedAvgSettings(clip_norm=self.dp_clip, noise_multiplier=self.dp_noise, delta=self.dp_delta,
                                budget=self.dp_budget)

    def _check_robustness(self) -> None:
        from coordinator.aggregation.robust import trim_count
        from coordinator.storage.audit_log import NORMS_KEPT

        if self.norm_check not in NORM_CHECK_MODES:
            raise ValueError(f"--norm-check must be one of {list(NORM_CHECK_MODES)}, got {self.norm_check!r}")
        if not self.norm_factor > 1:
            raise ValueError(f"--norm-factor must be > 1, got {self.norm_factor}")
        if not 1 <= self.norm_history <= NORMS_KEPT:
            raise ValueError(f"--norm-history must be 1-{NORMS_KEPT}, got {self.norm_history}")
        if not 1 <= self.norm_warmup <= self.norm_history:
            raise ValueError(f"--norm-warmup must be 1-{self.norm_history} (--norm-history), got {self.norm_warmup}")
        if self.robust != "none" and self.robust not in ROBUST_NAMES:
            raise ValueError(f"--robust must be one of {['none', *ROBUST_NAMES]}, got {self.robust!r}")
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

    def _check_secure_aggregation(self) -> None:
        if not self.secure_aggregation:
            return
        if self.aggregation != "fedbuff" or self.robust != "none" or self.buffer_size < 2:
            raise ValueError("--secure-aggregation makes each cohort of --buffer-size workers one step of their summed "
                             "updates: it needs --aggregation fedbuff, --buffer-size >= 2 and no --robust, got "
                             f"--aggregation {self.aggregation} --buffer-size {self.buffer_size} --robust {self.robust}")
        if self.secagg is None or self.secagg.cohort_size != self.buffer_size:
            base = self.secagg or SecAggSettings(cohort_size=self.buffer_size)
            object.__setattr__(self, "secagg", SecAggSettings(self.buffer_size, base.threshold, base.clip,
                                                              base.max_weight, base.round_timeout, base.input_timeout))

    @property
    def norm_policy(self) -> NormPolicy:
        return NormPolicy(self.norm_check, self.norm_factor, self.norm_history, self.norm_warmup)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))

    @property
    def updates_per_step(self) -> int:
        """FedBuff's K; 1 under --secure-aggregation, where each update is already a cohort's sum of K."""
        return self.buffer_size if self.aggregation == "fedbuff" and not self.secure_aggregation else 1


def _async_alpha(text: str) -> float | None:
    """``auto`` (None: 1 / the expert's workers, decided at each step) or a number in (0, 1]."""
    if text.strip().lower() == "auto":
        return None
    try:
        alpha = float(text)
    except ValueError:
        raise ValueError(f"--async-alpha must be a number in (0, 1] or auto, got {text!r}") from None
    if not 0 < alpha <= 1:
        raise ValueError(f"--async-alpha must be in (0, 1] or auto, got {text}")
    return alpha


def _gateway_weights(text: str) -> dict[str, float] | None:
    try:
        return parse_gateway_weights(text) if text else None
    except ValueError as exc:
        raise ValueError(f"--gateway-weights: {exc} (e.g. python_expert=2,sql_expert=1)") from None


@dataclass(frozen=True)
class ServeOptions:
    """How the coordinator listens; each field is a run_coordinator.py flag."""

    host: str = option("0.0.0.0", "address to listen on")
    port: int = option(5000, "port to listen on; 0 picks a free one")
    debug: bool = option(False, "use Flask's development server and debug logging")
    threads: int = option(16, "request threads: requests whose application code runs at once (connections are "
                              "not limited by it)")
    socket_timeout: float = option(60.0, "seconds a connection may stall mid-request (no byte read or written) "
                                         "before it is dropped", group=SECURITY)
    tls_cert: Path | None = option(None, "PEM certificate (chain): serve HTTPS", type=Path, group=SECURITY)
    tls_key: Path | None = option(None, "PEM private key of --tls-cert", type=Path, group=SECURITY)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be 0-65535, got {self.port}")
        if not self.socket_timeout > 0:
            raise ValueError(f"--socket-timeout must be > 0 seconds, got {self.socket_timeout}")
        if self.threads < 1:  # was "max_workers must be greater than 0", after the start-up lines said "listening"
            raise ValueError(f"--threads must be at least 1, got {self.threads}")


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
