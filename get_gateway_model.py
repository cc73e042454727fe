#!/usr/bin/env python3
"""Inspect the federation and download the gateway model.

Examples:
  python get_gateway_model.py                                  # gateway info
  python get_gateway_model.py --list-experts
  python get_gateway_model.py --save-gateway gateway_model.npz
  python get_gateway_model.py --save-gateway gateway.safetensors --coordinator-url http://10.0.0.5:5000
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from protocol.client import CoordinatorClient, RetryPolicy
from protocol.errors import FedMoEError

FORMATS = {".npz": "npz", ".safetensors": "safetensors"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--coordinator-url", default="http://127.0.0.1:5000",
                   help="coordinator address (default: %(default)s)")
    p.add_argument("--save-gateway", metavar="PATH", type=Path,
                   help="save the gateway adapter; format from the extension: .npz or .safetensors")
    p.add_argument("--list-experts", action="store_true", help="print a table of experts")
    p.add_argument("--use-proxy", action="store_true", help="honour HTTP(S)_PROXY for the coordinator")
    return p.parse_args(argv)


def write_atomically(path: Path, data: bytes) -> None:
    """Write to a temp file beside ``path`` and rename: never a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def experts_table(experts: list[dict[str, Any]]) -> str:
    header = ("name", "version", "updates", "samples", "rank", "last loss", "last update")
    rows = [(e["name"], str(e["version"]), str(e["updates_applied"]), str(e["samples_seen"]),
             str(e["lora"]["rank"]),
             "-" if e.get("last_train_loss") is None else f"{e['last_train_loss']:.4f}",
             time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["updated_at"])))
            for e in experts]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines) if rows else "no experts yet"


def save_gateway(client: CoordinatorClient, path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"--save-gateway: unknown extension {path.suffix!r}; use one of {sorted(FORMATS)}")
    if not path.parent.is_dir():
        raise ValueError(f"--save-gateway: directory {str(path.parent)!r} does not exist")
    info = client.gateway_info()
    write_atomically(path, client.gateway_weights(fmt))
    sources = ", ".join(f"{n} v{v} (w={info['weights'][n]:.3f})" for n, v in info["sources"].items())
    return f"saved gateway v{info['version']} ({info['strategy']}, rank {info['lora']['rank']}) to {path}: {sources}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    client = CoordinatorClient(args.coordinator_url, timeout=(5.0, 300.0),
                               retry=RetryPolicy(attempts=2), use_proxy=args.use_proxy)
    try:
        if args.list_experts:
            print(experts_table(client.list_experts()))
        if args.save_gateway:
            print(save_gateway(client, args.save_gateway))
        if not (args.list_experts or args.save_gateway):
            print(json.dumps(client.gateway_info(), indent=2))
    except (FedMoEError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
