"""What the three scripts share on the command line: --version, --log-format, and one-line errors.

Convention: a mistake the user can fix (a bad flag, a missing file, an unreachable coordinator,
a port in use) ends the script with one line ``error: <what> <how to fix it>`` on stderr and
exit code 2, like argparse's own usage errors; a traceback (exit 1) means a bug.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from urllib.parse import urlsplit

from protocol.errors import Unavailable
from protocol.logs import LOG_FORMATS, configure_logging
from protocol.version import __version__

EXIT_USAGE = 2


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"FedMoE {__version__}")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="text lines for people, or one JSON object per line for machines (default: %(default)s)")


def setup_logging(args: argparse.Namespace, level: int = logging.INFO) -> None:
    configure_logging(args.log_format, level)


def report_error(args: argparse.Namespace, message: object) -> int:
    """Print the one error line (a JSON object with --log-format json); returns the exit code."""
    text = str(message).strip().replace("\n", " ")
    if isinstance(message, Unavailable) and "--coordinator-url" not in text and "--use-proxy" not in text:
        text += "; is the coordinator running there? check --coordinator-url"
    if getattr(args, "log_format", "text") == "json":
        print(json.dumps({"level": "ERROR", "logger": "cli", "message": text}), file=sys.stderr)
    else:
        print(f"error: {text}", file=sys.stderr)
    return EXIT_USAGE


def check_coordinator_url(url: str) -> str:
    """Refuse what requests would only fail on later with a cryptic InvalidSchema/InvalidURL.

    A comma list (relays and the root, protocol/probe.py) is checked URL by URL.
    """
    for one in (url.split(",") if "," in url else [url]):
        parts = urlsplit(one.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--coordinator-url {one.strip()!r} is not an http(s) address; "
                             "use e.g. http://127.0.0.1:5000 (or several, comma-separated)")
    return url
