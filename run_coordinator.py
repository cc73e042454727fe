#!/usr/bin/env python3
"""Run the FedMoE coordinator.

Examples:
  python run_coordinator.py --port 5000
  python run_coordinator.py --aggregation fedbuff --buffer-size 4 --data-dir /srv/fedmoe
  python run_coordinator.py --gateway-weights python_expert=2,sql_expert=1
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from coordinator.aggregation import AGGREGATORS
from coordinator.config import CoordinatorConfig, parse_gateway_weights
from coordinator.server import ServeOptions, ServerStartError, serve
from gateway.merges import MERGES
from gateway.router import DEFAULT_THRESHOLD


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=5000, help="port to listen on; 0 picks a free one (default: %(default)s)")
    p.add_argument("--debug", action="store_true", help="use Flask's development server and debug logging")
    p.add_argument("--data-dir", default="./fedmoe-data", help="where experts are stored (default: %(default)s)")
    p.add_argument("--aggregation", choices=sorted(AGGREGATORS), default="fedasync",
                   help="fedasync applies each update at once; fedbuff waits for --buffer-size (default: %(default)s)")
    p.add_argument("--server-lr", type=float, default=1.0, help="step size on aggregated deltas (default: %(default)s)")
    p.add_argument("--staleness-decay", type=float, default=0.1,
                   help="updates weigh 1/(1 + decay * staleness) (default: %(default)s)")
    p.add_argument("--buffer-size", type=int, default=3, help="K updates per fedbuff step (default: %(default)s)")
    p.add_argument("--keep-versions", type=int, default=20,
                   help="newest versions per expert kept downloadable (default: %(default)s)")
    p.add_argument("--gateway-weights", type=str, default=None, metavar="NAME=W,...",
                   help="per-expert gateway weights (default: proportional to samples trained)")
    p.add_argument("--gateway-strategy", choices=sorted(MERGES), default="weighted_average",
                   help="merge used for the gateway (default: %(default)s, exact)")
    p.add_argument("--route-threshold", type=float, default=DEFAULT_THRESHOLD,
                   help="router confidence below which prompts go to the gateway (default: %(default)s)")
    p.add_argument("--max-body-mb", type=float, default=1024.0, help="largest accepted request body (default: %(default)s)")
    p.add_argument("--threads", type=int, default=16, help="request threads (default: %(default)s)")
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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        weights = parse_gateway_weights(args.gateway_weights) if args.gateway_weights else None
        config = CoordinatorConfig(
            data_dir=args.data_dir, aggregation=args.aggregation, server_lr=args.server_lr,
            staleness_decay=args.staleness_decay, buffer_size=args.buffer_size,
            keep_versions=args.keep_versions, gateway_weights=weights,
            gateway_strategy=args.gateway_strategy, route_threshold=args.route_threshold, max_body_mb=args.max_body_mb,
            auth=not args.no_auth, admin_token_file=args.admin_token_file, token_ttl_hours=args.token_ttl_hours,
            rate_limit=args.rate_limit)
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be 0-65535, got {args.port}")
        if not args.socket_timeout > 0:
            raise ValueError(f"--socket-timeout must be > 0 seconds, got {args.socket_timeout}")
        serve(config, ServeOptions(host=args.host, port=args.port, debug=args.debug, threads=args.threads,
                                   socket_timeout=args.socket_timeout, tls_cert=args.tls_cert, tls_key=args.tls_key))
    except (ValueError, ServerStartError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
