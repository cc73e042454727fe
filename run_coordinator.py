#!/usr/bin/env python3
"""Run the FedMoE coordinator.

Examples:
  python run_coordinator.py --port 5000
  python run_coordinator.py --aggregation fedbuff --buffer-size 4 --data-dir /srv/fedmoe
  python run_coordinator.py --gateway-weights python_expert=2,sql_expert=1
  python run_coordinator.py --port 0 --log-format json     # a free port; JSON log lines for machines
  python run_coordinator.py --aggregation fedbuff --buffer-size 5 --robust trimmed_mean --norm-check reject
"""
from __future__ import annotations

import argparse
import logging
import sys

# Light imports only: --help and flag errors must not wait for torch, Flask or gunicorn (main imports them).
from coordinator.config import CoordinatorConfig, ServeOptions
from protocol.cli import add_common_flags, add_flags, from_flags, report_error, setup_logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags, defaults and help come from the config dataclasses' fields (protocol.cli.option)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, ServeOptions)
    add_flags(p, CoordinatorConfig)
    add_common_flags(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args, logging.DEBUG if args.debug else logging.INFO)
    from coordinator.server import ServerStartError, serve

    try:
        config = from_flags(CoordinatorConfig, args)
        serve(config, from_flags(ServeOptions, args))
    except (ValueError, ServerStartError, OSError) as exc:
        return report_error(args, exc)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
