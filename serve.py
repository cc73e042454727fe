#!/usr/bin/env python3
"""Serve the federation's experts over an OpenAI-compatible API (docs/serving.md).

Examples:
  python serve.py --coordinator-url http://127.0.0.1:5000 --port 8000
  python serve.py --port 8000 --api-key-file keys.txt --poll-interval 5 --max-tokens 512

Then any OpenAI client works: base_url http://127.0.0.1:8000/v1, the key from --api-key-file,
model = an expert's name, "gateway", "routed", "mixture", or "auto" (the measured best of them: the mixture).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from gateway.errors import GatewayError
from protocol.cli import add_common_flags, add_flags, check_coordinator_url, from_flags, option, report_error, setup_logging
from protocol.credentials import config_dir
from protocol.errors import FedMoEError
from protocol.python_version import require_supported_python
from serving.config import EngineOptions, Limits, ServeOptions


@dataclass(frozen=True, kw_only=True)
class ServeFlags:
    """serve.py's flags besides serving.config's Limits and EngineOptions, one field each (protocol.cli.option)."""

    coordinator_url: str = option("http://127.0.0.1:5000", "coordinator")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on; 0 picks a free one")
    token: str | None = option(None, "coordinator admin token (default: $FEDMOE_TOKEN, or found automatically when "
                                     "the coordinator runs on this machine)")
    ca_cert: Path | None = option(None, "PEM file to trust for an https:// coordinator", type=Path)
    use_proxy: bool = option(False, "honour HTTP(S)_PROXY for the coordinator")
    base_model: str | None = option(None, "base model (default: the one the experts were trained from)")
    use_huggingface: bool = option(False, "load --base-model from the Hugging Face hub")
    poll_interval: float = option(10.0, "seconds between polls for new expert versions")
    api_key_file: Path = option(help="API keys clients must send as 'Authorization: Bearer KEY', one per line; "
                                     "created with a random key if missing",
                                default_factory=lambda: config_dir() / "serve-api-keys", type=Path)
    no_auth: bool = option(False, "no API key (only with a loopback --host)")
    route_threshold: float | None = option(None, "confidence below which 'routed' answers with the gateway (default: "
                                                 "the coordinator's)", type=float)
    threads: int | None = option(None, "torch threads for generation (default: torch's)", type=int)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flags in (ServeFlags, Limits, EngineOptions):
        add_flags(p, flags)
    add_common_flags(p)
    return p.parse_args(argv)


def options_from(args: argparse.Namespace) -> ServeOptions:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0-65535, got {args.port}")
    return ServeOptions(host=args.host, port=args.port, base_model=args.base_model,
                        use_huggingface=args.use_huggingface, poll_interval=args.poll_interval,
                        api_key_file=None if args.no_auth else args.api_key_file,
                        route_threshold=args.route_threshold, limits=from_flags(Limits, args),
                        engine=from_flags(EngineOptions, args))


def main(argv: list[str] | None = None) -> int:
    require_supported_python()  # before anything that would fail obscurely on an older one
    args = parse_args(argv)
    setup_logging(args)
    try:
        options = options_from(args)  # every flag checked before torch is imported: a mistake answers at once
        check_coordinator_url(args.coordinator_url)
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be a positive integer, got {args.threads}")
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        from protocol.client import CoordinatorClient, RetryPolicy  # torch: not for --help
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
