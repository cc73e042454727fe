#!/usr/bin/env python3
"""Run the FedMoE coordinator.

Examples:
  python run_coordinator.py --port 5000
  python run_coordinator.py --aggregation fedbuff --buffer-size 4 --data-dir /srv/fedmoe
  python run_coordinator.py --gateway-weights python_expert=2,sql_expert=1
  python run_coordinator.py --port 0 --log-format json     # a free port; JSON log lines for machines
  python run_coordinator.py --aggregation fedbuff --buffer-size 5 --robust trimmed_mean --norm-check reject
  python run_coordinator.py --upstream http://root:5000 --join-token-file join_token --port 5001   # a relay
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

# Light imports only: --help and flag errors must not wait for torch, Flask or gunicorn (main imports them).
from coordinator.choices import AGGREGATION_NAMES, ROBUST_NAMES
from coordinator.norm_check import NORM_CHECK_MODES
from gateway.choices import DEFAULT_ROUTE_THRESHOLD, MERGE_NAMES
from protocol.cli import add_common_flags, report_error, setup_logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=5000, help="port to listen on; 0 picks a free one (default: %(default)s)")
    p.add_argument("--debug", action="store_true", help="use Flask's development server and debug logging")
    p.add_argument("--data-dir", default="./fedmoe-data", help="where experts are stored (default: %(default)s)")
    p.add_argument("--aggregation", choices=AGGREGATION_NAMES, default="fedasync",
                   help="fedasync applies each update at once; fedbuff waits for --buffer-size (default: %(default)s)")
    p.add_argument("--server-lr", type=float, default=1.0, help="step size on aggregated deltas (default: %(default)s)")
    p.add_argument("--staleness-decay", type=float, default=0.1,
                   help="updates weigh 1/(1 + decay * staleness) (default: %(default)s)")
    p.add_argument("--buffer-size", type=int, default=3, help="K updates per fedbuff step (default: %(default)s)")
    p.add_argument("--keep-versions", type=int, default=20,
                   help="newest versions per expert kept downloadable (default: %(default)s)")
    p.add_argument("--gateway-weights", type=str, default=None, metavar="NAME=W,...",
                   help="per-expert gateway weights (default: proportional to samples trained)")
    p.add_argument("--gateway-strategy", choices=MERGE_NAMES, default="weighted_average",
                   help="merge used for the gateway (default: %(default)s, exact)")
    p.add_argument("--gateway-config", default="{}", metavar="JSON",
                   help='settings of --gateway-strategy, e.g. \'{"density": 0.2}\' for ties, \'{"p": 0.5, "lam": 1.0}\' '
                        "for dare; keys: density, p, seed, lam, rank by strategy (default: its defaults)")
    p.add_argument("--gateway-interval", type=float, default=30.0,
                   help="seconds between gateway builds at most; expert changes in between coalesce "
                        "(default: %(default)s)")
    p.add_argument("--keep-gateways", type=int, default=2,
                   help="newest built gateways kept on disk (default: %(default)s)")
    p.add_argument("--route-threshold", type=float, default=DEFAULT_ROUTE_THRESHOLD,
                   help="router confidence below which prompts go to the gateway (default: %(default)s)")
    p.add_argument("--max-body-mb", type=float, default=1024.0, help="largest accepted request body (default: %(default)s)")
    p.add_argument("--threads", type=int, default=16, help="request threads (default: %(default)s)")
    b = p.add_argument_group("backends for replicas (docs/scale.md)")
    b.add_argument("--manifest", default=None, metavar="postgresql://USER@HOST:PORT/DB",
                   help="keep the manifest in PostgreSQL, shared by every replica (default: SQLite in --data-dir)")
    b.add_argument("--blobs", default=None, metavar="s3://BUCKET/PREFIX",
                   help="keep blobs in an S3-compatible store (endpoint and keys from AWS_ENDPOINT_URL, "
                        "AWS_ACCESS_KEY_ID, ...; default: files in --data-dir)")
    b.add_argument("--redirect-pulls-mb", type=float, default=1.0,
                   help="with --blobs: redirect weight pulls of at least this many MiB to a presigned URL "
                        "(default: %(default)s; 0 = never)")
    s = p.add_argument_group("security (README, \"Security\")")
    s.add_argument("--no-auth", action="store_true",
                   help="accept requests without tokens; only on a trusted lab network")
    s.add_argument("--admin-token-file", type=Path, default=None,
                   help="file holding the admin token (default: <data-dir>/admin_token, made on first start)")
    s.add_argument("--token-ttl-hours", type=float, default=168.0,
                   help="worker tokens expire after this long; workers renew them (default: %(default)s)")
    s.add_argument("--rate-limit", type=float, default=600.0,
                   help="requests per minute one worker may make, 0 = no limit (default: %(default)s)")
    s.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate: serve HTTPS")
    s.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    s.add_argument("--socket-timeout", type=float, default=60.0,
                   help="seconds a connection may stall mid-request before it is dropped (default: %(default)s)")
    p.add_argument("--norm-check", choices=NORM_CHECK_MODES, default="off",
                   help="reject (422) or clip updates whose L2 norm is over --norm-factor x the median of the "
                        "expert's recent accepted norms (default: %(default)s)")
    p.add_argument("--norm-factor", type=float, default=10.0, help="norm limit multiple (default: %(default)s)")
    p.add_argument("--norm-history", type=int, default=20,
                   help="recent accepted norms the median is taken over (default: %(default)s)")
    p.add_argument("--norm-warmup", type=int, default=5,
                   help="accepted updates before the norm check applies (default: %(default)s)")
    p.add_argument("--robust", choices=["none", *ROBUST_NAMES], default="none",
                   help="robust combination of each fedbuff buffer (default: %(default)s = weighted mean)")
    p.add_argument("--trim-fraction", type=float, default=0.2,
                   help="share of values trimmed at each end by --robust trimmed_mean (default: %(default)s)")
    r = p.add_argument_group("relay (docs/wan.md, \"Relays\"): with --upstream this process is a relay")
    r.add_argument("--upstream", default=None, metavar="URL",
                   help="root coordinator to relay to; workers then register, push and pull here")
    r.add_argument("--join-token-file", type=Path, default=None,
                   help="file holding the root's join token (default: $FEDMOE_JOIN_TOKEN); the relay joins "
                        "with it, and its workers join the relay with it")
    r.add_argument("--forward-interval", type=float, default=10.0,
                   help="seconds between combined updates sent upstream (default: %(default)s)")
    r.add_argument("--forward-compression", default="safetensors", metavar="CODEC",
                   help="codec of the combined update, with error feedback, e.g. topk+int8 "
                        "(default: %(default)s = lossless)")
    r.add_argument("--forward-compression-config", default="{}", metavar="JSON",
                   help='settings of --forward-compression, e.g. \'{"ratio": 0.05}\' (default: its defaults)')
    r.add_argument("--relay-id", default=None, help="this relay's name at the root (default: host name and port)")
    r.add_argument("--advertise-url", default=None, metavar="URL",
                   help="URL workers reach this relay at, published at the root's /api/v1/relays")
    r.add_argument("--max-queue-mb", type=float, default=1024.0,
                   help="updates held for forwarding at most; a push beyond is a 507 (default: %(default)s)")
    r.add_argument("--base-model-fingerprint", default=None, metavar="HEX",
                   help="pin the base model: refuse to start under a root, and refuse workers, of another one")
    add_common_flags(p)
    return p.parse_args(argv)


def _gateway_weights(text: str | None) -> dict[str, float] | None:
    from coordinator.config import parse_gateway_weights

    try:
        return parse_gateway_weights(text) if text else None
    except ValueError as exc:
        raise ValueError(f"--gateway-weights: {exc} (e.g. python_expert=2,sql_expert=1)") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args, logging.DEBUG if args.debug else logging.INFO)
    from coordinator.config import CoordinatorConfig
    from coordinator.relay.upstream import RelayStartError
    from coordinator.server import ServeOptions, ServerStartError, serve
    from protocol.schemas import parse_json_flag

    try:
        weights = _gateway_weights(args.gateway_weights)
        config = CoordinatorConfig(
            data_dir=args.data_dir, aggregation=args.aggregation, server_lr=args.server_lr,
            staleness_decay=args.staleness_decay, buffer_size=args.buffer_size,
            keep_versions=args.keep_versions, gateway_weights=weights,
            gateway_strategy=args.gateway_strategy,
            gateway_config=parse_json_flag(args.gateway_config, "--gateway-config"),
            gateway_interval=args.gateway_interval, keep_gateways=args.keep_gateways,
            route_threshold=args.route_threshold, max_body_mb=args.max_body_mb, manifest=args.manifest,
            blobs=args.blobs, redirect_pulls_mb=args.redirect_pulls_mb,
            auth=not args.no_auth, admin_token_file=args.admin_token_file, token_ttl_hours=args.token_ttl_hours,
            rate_limit=args.rate_limit,
            norm_check=args.norm_check, norm_factor=args.norm_factor, norm_history=args.norm_history,
            norm_warmup=args.norm_warmup, robust=args.robust, trim_fraction=args.trim_fraction)
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be 0-65535, got {args.port}")
        if not args.socket_timeout > 0:
            raise ValueError(f"--socket-timeout must be > 0 seconds, got {args.socket_timeout}")
        options = ServeOptions(host=args.host, port=args.port, debug=args.debug, threads=args.threads,
                               socket_timeout=args.socket_timeout, tls_cert=args.tls_cert, tls_key=args.tls_key)
        if args.upstream:
            return _serve_relay(args, config, options)
        serve(config, options)
    except (ValueError, ServerStartError, OSError, RelayStartError) as exc:
        return report_error(args, exc)
    except KeyboardInterrupt:
        return 0
    return 0


def _serve_relay(args: argparse.Namespace, base, options) -> int:
    """Build the relay's config from the flags and serve it (coordinator.relay)."""
    import os

    from compression.errors import CompressionError
    from compression.registry import make_codec
    from coordinator.relay.forwarder import ForwardPolicy
    from coordinator.relay.server import serve_relay
    from coordinator.relay.service import RelayConfig
    from protocol.schemas import RAW_CODEC, parse_json_flag

    codec_config = parse_json_flag(args.forward_compression_config, "--forward-compression-config")
    if args.forward_compression != RAW_CODEC:
        try:
            make_codec(args.forward_compression, codec_config)
        except (CompressionError, ValueError, TypeError) as exc:
            raise ValueError(f"--forward-compression {args.forward_compression!r}: {exc}") from None
    join_token = os.environ.get("FEDMOE_JOIN_TOKEN")
    if args.join_token_file is not None:
        if not args.join_token_file.is_file():
            raise ValueError(f"--join-token-file {str(args.join_token_file)!r} does not exist")
        join_token = args.join_token_file.read_text().strip()
    config = RelayConfig(
        upstream=args.upstream.rstrip("/"), coordinator=base, join_token=join_token, relay_id=args.relay_id,
        advertise_url=args.advertise_url, max_queue_mb=args.max_queue_mb,
        base_model_fingerprint=args.base_model_fingerprint,
        forward=ForwardPolicy(interval=args.forward_interval, codec=args.forward_compression,
                              codec_config=codec_config, staleness_decay=args.staleness_decay))
    serve_relay(config, options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
