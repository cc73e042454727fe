#!/usr/bin/env python3
"""Run the FedMoE coordinator.

Examples:
  python run_coordinator.py --port 5000
  python run_coordinator.py --aggregation fedbuff --buffer-size 4 --data-dir /srv/fedmoe
  python run_coordinator.py --gateway-weights python_expert=2,sql_expert=1
  python run_coordinator.py --port 0 --log-format json     # a free port; JSON log lines for machines
  python run_coordinator.py --aggregation fedbuff --buffer-size 5 --robust trimmed_mean --norm-check reject
  python run_coordinator.py --manifest postgresql://db/fedmoe --blobs s3://fedmoe/prod --quarantine sql_expert
  # a relay, with join_token and relay_join_token copied from the root's data dir:
  python run_coordinator.py --upstream http://root:5000 --join-token-file join_token --relay-join-token-file relay_join_token
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# Light imports only: --help and flag errors must not wait for torch, Flask or gunicorn (main imports them).
from coordinator.config import CoordinatorConfig, ServeOptions
from privacy.secagg.settings import SecAggSettings
from protocol.cli import add_common_flags, add_flags, comma_list, from_flags, json_object, option, report_error, \
    setup_logging
from protocol.python_version import require_supported_python


RELAY = 'relay (docs/wan.md, "Relays placed by hand"): with --upstream this process is a relay'


@dataclass(frozen=True)
class RelayFlags:
    """A relay's own settings (coordinator.relay.service.RelayConfig is built from these and the config)."""

    upstream: str | None = option(None, "root coordinator to relay to; workers then register, push and pull here",
                                  metavar="URL", group=RELAY)
    join_token_file: Path | None = option(None, "file holding the root's join token (default: $FEDMOE_JOIN_TOKEN); "
                                                "the relay's workers join the relay with it", type=Path, group=RELAY)
    relay_join_token_file: Path | None = option(None, "file holding the root's relay join token (its data dir's "
                                                      "relay_join_token; default: $FEDMOE_RELAY_JOIN_TOKEN); the "
                                                      "relay registers at the root with it", type=Path, group=RELAY)
    forward_interval: float = option(10.0, "at most one combined update upstream per expert every SECONDS "
                                           "(an update reaching an idle relay goes at once)", group=RELAY)
    forward_on_exit: bool = option(False, "on SIGTERM, stop taking requests, then forward what is queued before "
                                          "exiting (what does not go stays queued in the data dir, as always); "
                                          "`run_worker.py --can-relay` starts its relay with it", group=RELAY)
    forward_compression: str = option("safetensors", "codec of the combined update, with error feedback, e.g. "
                                                     "topk+int8 (safetensors = lossless)", metavar="CODEC", group=RELAY)
    forward_compression_config: Mapping[str, Any] = option(
        help='settings of --forward-compression, e.g. \'{"ratio": 0.05}\' (default: its defaults)',
        default_factory=dict, metavar="JSON", parse=json_object, group=RELAY)
    upstream_pull_compression: str | None = option(
        None, "fetch new root versions as compressed diffs since the cached one, e.g. int8 (default: full weights, "
              "byte for byte the root's); the relay then serves the root's weights within the codec's error",
        metavar="CODEC", group=RELAY)
    upstream_pull_compression_config: Mapping[str, Any] = option(
        help="settings of --upstream-pull-compression (default: its defaults)", default_factory=dict, metavar="JSON",
        parse=json_object, group=RELAY)
    upstream_full_pull_every: int = option(10, "with --upstream-pull-compression, every N-th fetch is a full one",
                                           group=RELAY)
    site_model: bool = option(False, "serve the site's workers the root's weights plus their updates not yet in "
                                     "them, each weighted as --async-alpha says (auto: 1 / the site's workers of "
                                     "the expert), and forward their weighted sum (hierarchical FL's edge model; "
                                     "docs/wan.md)", group=RELAY)
    relay_id: str | None = option(None, "this relay's name at the root (default: host name and port)", group=RELAY)
    advertise_url: str | None = option(None, "URL workers reach this relay at, published at the root's "
                                             "/api/v1/relays", metavar="URL", group=RELAY)
    max_queue_mb: float = option(1024.0, "updates held for forwarding at most (MiB); a push beyond is a 507",
                                 group=RELAY)
    base_model_fingerprint: str | None = option(None, "pin the base model: refuse to start under a root, and refuse "
                                                      "workers, of another one", metavar="HEX", group=RELAY)


ADMIN = "admin commands (docs/operations.md): do this with the coordinator's own store flags, then exit"


@dataclass(frozen=True)
class AdminFlags:
    """One-off commands an operator runs on a coordinator's store instead of serving it."""

    quarantine: tuple[str, ...] = option(
        (), "set aside what start-up refused to: for each EXPERT whose current weights are missing or unusable, "
            "remove it (its pending updates become quarantined, their ids still answer); else quarantine its "
            "pending updates that cannot be applied; then exit. A copy of each readable blob is kept in "
            "DATA_DIR/quarantine. Give the coordinator's --data-dir, --manifest and --blobs (default: none, serve)",
        metavar="EXPERT[,EXPERT]", parse=comma_list, group=ADMIN)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags, defaults and help come from the config dataclasses' fields (protocol.cli.option)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, ServeOptions)
    add_flags(p, CoordinatorConfig)
    add_flags(p, SecAggSettings)
    add_flags(p, RelayFlags)
    add_flags(p, AdminFlags)
    add_common_flags(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    require_supported_python()  # before anything that would fail obscurely on an older one
    args = parse_args(argv)
    setup_logging(args, logging.DEBUG if args.debug else logging.INFO)
    from coordinator.relay.upstream import RelayStartError
    from coordinator.http.serve import ServerStartError
    from coordinator.server import serve
    from protocol.errors import Unavailable

    try:
        config = from_flags(CoordinatorConfig, args)
        if config.secure_aggregation:
            config = replace(config, secagg=from_flags(SecAggSettings, args, cohort_size=config.buffer_size))
        options = from_flags(ServeOptions, args)
        relay = from_flags(RelayFlags, args)
        admin = from_flags(AdminFlags, args)
        if admin.quarantine:
            return _quarantine(config, admin.quarantine)
        if relay.upstream:
            return _serve_relay(relay, config, options)
        serve(config, options)
    except (ValueError, ServerStartError, OSError, RelayStartError) as exc:
        return report_error(args, exc)
    except Unavailable as exc:  # a database or object store down at start: its message says which
        return report_error(args, exc.message)
    except KeyboardInterrupt:
        return 0
    return 0


def _quarantine(config: CoordinatorConfig, names: tuple[str, ...]) -> int:
    """--quarantine: set aside what is unusable of the named experts (coordinator/quarantine.py), say what was done."""
    from coordinator.storage.data_dir import ROOT, claim_data_dir
    from coordinator.quarantine import quarantine_command

    lock = claim_data_dir(config.data_dir, ROOT)  # not while a coordinator serves this data dir
    try:
        for line in quarantine_command(config, names):
            print(line)
    finally:
        lock.close()
    return 0


def _serve_relay(args: RelayFlags, base: CoordinatorConfig, options: ServeOptions) -> int:
    """Build the relay's config from the flags and serve it (coordinator.relay)."""
    from compression.errors import CompressionError
    from compression.registry import make_codec
    from coordinator.relay.forwarder import ForwardPolicy
    from coordinator.relay.server import serve_relay
    from coordinator.relay.config import RelayConfig
    from coordinator.relay.upstream import DiffPulls
    from protocol.schemas import RAW_CODEC

    codec_config = dict(args.forward_compression_config)
    if args.forward_compression != RAW_CODEC:
        try:
            make_codec(args.forward_compression, codec_config)
        except (CompressionError, ValueError, TypeError) as exc:
            raise ValueError(f"--forward-compression {args.forward_compression!r}: {exc}") from None
    upstream_diffs = None
    if args.upstream_pull_compression is not None:
        try:
            upstream_diffs = DiffPulls(args.upstream_pull_compression, dict(args.upstream_pull_compression_config),
                                       args.upstream_full_pull_every)
        except (CompressionError, TypeError) as exc:
            raise ValueError(f"--upstream-pull-compression {args.upstream_pull_compression!r}: {exc}") from None
    join_token = _token_from(args.join_token_file, "--join-token-file", "FEDMOE_JOIN_TOKEN")
    relay_join_token = _token_from(args.relay_join_token_file, "--relay-join-token-file", "FEDMOE_RELAY_JOIN_TOKEN")
    assert args.upstream is not None
    config = RelayConfig(
        upstream=args.upstream.rstrip("/"), coordinator=base, join_token=join_token,
        relay_join_token=relay_join_token, relay_id=args.relay_id,
        advertise_url=args.advertise_url, max_queue_mb=args.max_queue_mb,
        base_model_fingerprint=args.base_model_fingerprint, upstream_diffs=upstream_diffs, site_model=args.site_model,
        forward=ForwardPolicy(interval=args.forward_interval, codec=args.forward_compression,
                              codec_config=codec_config, staleness_decay=base.staleness_decay,
                              on_exit=args.forward_on_exit))
    serve_relay(config, options)
    return 0


def _token_from(path: Path | None, flag: str, variable: str) -> str | None:
    """The token in the file ``path`` (flag ``flag``), else in the environment variable ``variable``, else None."""
    if path is None:
        return os.environ.get(variable)
    if not path.is_file():
        raise ValueError(f"{flag} {str(path)!r} does not exist")
    return path.read_text().strip()


if __name__ == "__main__":
    sys.exit(main())
