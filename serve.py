#!/usr/bin/env python3
"""Serve the federation's experts over an OpenAI-compatible API (docs/serving.md).

Examples:
  python serve.py --coordinator-url http://127.0.0.1:5000 --port 8000
  python serve.py --port 8000 --api-key-file keys.txt --poll-interval 5 --max-tokens 512

Then any OpenAI client works: base_url http://127.0.0.1:8000/v1, the key from --api-key-file,
model = an expert's name, "gateway", or "auto" (routed per request).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gateway.errors import GatewayError
from protocol.cli import add_common_flags, check_coordinator_url, report_error, setup_logging
from protocol.client import CoordinatorClient, RetryPolicy
from protocol.credentials import config_dir
from protocol.errors import FedMoEError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from serving.config import EngineOptions, Limits

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--coordinator-url", default="http://127.0.0.1:5000", help="coordinator (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    p.add_argument("--token", default=None, help="coordinator admin token (default: $FEDMOE_TOKEN, or found "
                                                 "automatically when the coordinator runs on this machine)")
    p.add_argument("--ca-cert", type=Path, default=None, help="PEM file to trust for an https:// coordinator")
    p.add_argument("--use-proxy", action="store_true", help="honour HTTP(S)_PROXY for the coordinator")
    p.add_argument("--base-model", default=None, help="base model (default: the one the experts were trained from)")
    p.add_argument("--use-huggingface", action="store_true", help="load --base-model from the Hugging Face hub")
    p.add_argument("--poll-interval", type=float, default=10.0,
                   help="seconds between polls for new expert versions (default: %(default)s)")
    p.add_argument("--api-key-file", type=Path, default=config_dir() / "serve-api-keys",
                   help="API keys clients must send as 'Authorization: Bearer KEY', one per line; created with a "
                        "random key if missing (default: %(default)s)")
    p.add_argument("--no-auth", action="store_true", help="no API key (only with a loopback --host)")
    p.add_argument("--route-threshold", type=float, default=None,
                   help="confidence below which 'auto' answers with the gateway (default: the coordinator's)")
    p.add_argument("--max-tokens", type=int, default=Limits.max_tokens, help="largest max_tokens (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=Limits.max_prompt_tokens,
                   help="longest prompt in tokens (default: %(default)s)")
    p.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes,
                   help="largest request body (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=Limits.timeout,
                   help="seconds a request may take, queueing included (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=Limits.max_queue,
                   help="requests waiting at once before 429s (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=EngineOptions.max_batch,
                   help="requests generated together, any mix of experts (default: %(default)s)")
    p.add_argument("--batch-wait", type=float, default=EngineOptions.batch_wait,
                   help="seconds to wait for a batch to fill (default: %(default)s)")
    p.add_argument("--no-mix-adapters", action="store_true",
                   help="generate a batch's rows of each adapter separately instead of in one call (see "
                        "docs/serving.md for which is faster)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for generation (default: torch's)")
    add_common_flags(p)
    return p.parse_args(argv)


def options_from(args: argparse.Namespace):
    from serving.config import EngineOptions, Limits
    from serving.server import ServeOptions

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0-65535, got {args.port}")
    limits = Limits(max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens,
                    max_body_bytes=args.max_body_bytes, timeout=args.timeout, max_queue=args.max_queue)
    return ServeOptions(host=args.host, port=args.port, base_model=args.base_model,
                        use_huggingface=args.use_huggingface, poll_interval=args.poll_interval,
                        api_key_file=None if args.no_auth else args.api_key_file,
                        route_threshold=args.route_threshold, limits=limits,
                        engine=EngineOptions(max_batch=args.max_batch, batch_wait=args.batch_wait,
                                              mix_adapters=not args.no_mix_adapters))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args)
    try:
        options = options_from(args)
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"--threads must be a positive integer, got {args.threads}")
            import torch

            torch.set_num_threads(args.threads)
        from serving.server import serve

        client = CoordinatorClient(check_coordinator_url(args.coordinator_url), timeout=(5.0, 300.0),
                                   retry=RetryPolicy(attempts=2), use_proxy=args.use_proxy, token=args.token,
                                   ca_cert=args.ca_cert)
        serve(client, options)
    except KeyboardInterrupt:
        return 0
    except (FedMoEError, GatewayError, ValueError, OSError) as exc:
        return report_error(args, exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
