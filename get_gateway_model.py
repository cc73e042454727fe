#!/usr/bin/env python3
"""Inspect the federation, download the gateway (or one expert), or answer a prompt with it.

Examples:
  python get_gateway_model.py                                  # gateway info
  python get_gateway_model.py --list-experts
  python get_gateway_model.py --save-gateway                   # to ./gateway_model.npz
  python get_gateway_model.py --save-gateway gw.safetensors --strategy ties --strategy-config '{"density": 0.3}'
  python get_gateway_model.py --save-gateway sql_adapter --format peft --expert sql_expert
  python get_gateway_model.py --save-gateway merged_model --format merged
  python get_gateway_model.py --generate "Write a SQL query that counts orders per customer"
  python get_gateway_model.py --coordinator-url http://10.0.0.5:5000 --list-experts
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Light imports only: --help and flag errors must not wait for torch (the work below imports it).
from gateway.choices import MERGE_NAMES
from gateway.errors import GatewayError
from protocol.cli import add_common_flags, add_flags, check_coordinator_url, json_object, option, report_error, setup_logging
from protocol.errors import FedMoEError, NotFound

if TYPE_CHECKING:
    from gateway.download import Adapter
    from protocol.client import CoordinatorClient

DEFAULT_SAVE_PATH = Path("gateway_model.npz")
FORMATS = ("npz", "safetensors", "peft", "merged")
"""gateway.local.FORMATS, here without importing torch."""


@dataclass(frozen=True, kw_only=True)
class GatewayToolFlags:
    """get_gateway_model.py's flags, one field each (protocol.cli.option)."""

    coordinator_url: str = option("http://127.0.0.1:5000", "coordinator address")
    list_experts: bool = option(False, "print a table of experts")
    save_gateway: Path | None = option(
        None, "save the gateway (or --expert) to PATH: a file for npz/safetensors, a directory for peft/merged "
              f"(no PATH: {DEFAULT_SAVE_PATH} in the current directory)",
        type=Path, nargs="?", const=DEFAULT_SAVE_PATH, metavar="PATH")
    format: str | None = option(None, "npz, safetensors (default: from PATH's extension), peft (adapter directory "
                                      "for PeftModel.from_pretrained) or merged (full model directory)",
                                choices=FORMATS)
    expert: str | None = option(None, "use this expert instead of the gateway", metavar="NAME")
    strategy: str | None = option(None, "merge the experts here with this strategy instead of using the "
                                        "coordinator's gateway", choices=MERGE_NAMES)
    strategy_config: str = option("{}", 'options, e.g. \'{"density": 0.3}\'', metavar="JSON")
    generate: str | None = option(None, "answer PROMPT locally with the expert the coordinator routes it to (or the "
                                        "gateway)", metavar="PROMPT")
    max_new_tokens: int = option(128, "length of a --generate answer")
    base_model: str | None = option(None, "base model for --format merged / --generate (default: the one the "
                                          "experts were trained from, e.g. tiny-qwen2 or a hub id); a local "
                                          "directory works too")
    use_huggingface: bool = option(False, "load --base-model from the Hugging Face hub")
    overwrite: bool = option(False, "replace an existing output")
    use_proxy: bool = option(False, "honour HTTP(S)_PROXY for the coordinator")
    token: str | None = option(None, "admin token (default: $FEDMOE_TOKEN, or found automatically when the "
                                     "coordinator runs on this machine)")
    ca_cert: Path | None = option(None, "PEM certificate (or CA) to trust for an https:// coordinator with a "
                                        "private certificate", type=Path)
    revoke_worker: list[str] = option(help="admin: revoke a worker's tokens; it cannot register again (repeatable)",
                                      default_factory=list, action="append", metavar="WORKER_ID")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, GatewayToolFlags)
    add_common_flags(p)
    return p.parse_args(argv)


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell; numeric columns right-aligned so digits line up."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    numeric = [all(_is_number(r[i]) for r in rows) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip()

    return "\n".join(line(row) for row in [header, *rows])


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return cell == "-"
    return True


def when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def experts_table(experts: list[dict[str, Any]]) -> str:
    if not experts:
        return "no experts yet"
    return table(("name", "version", "updates", "samples", "rank", "last loss", "last update", "privacy (eps, delta)"),
                 [(e["name"], str(e["version"]), str(e["updates_applied"]), str(e["samples_seen"]),
                   "full" if e.get("kind") == "full" else str(e["lora"]["rank"]),
                   "-" if e.get("last_train_loss") is None else f"{e['last_train_loss']:.4f}", when(e["updated_at"]),
                   privacy_cell(e.get("privacy")))
                  for e in experts])


def privacy_cell(privacy: dict[str, Any] | None) -> str:
    """The expert's privacy spent: worker-level DP-FedAvg (its budget) and the largest DP-SGD claim of its workers."""
    if not privacy:
        return "-"
    parts = []
    fedavg = privacy.get("dp_fedavg")
    if fedavg:
        budget = f" of {fedavg['budget']:g}" if fedavg.get("budget") is not None else ""
        parts.append(f"worker-level ({fedavg['epsilon']:.3g}{budget}, {fedavg['delta']:g})")
    claims = privacy.get("dp_sgd") or {}
    if claims:
        worst = max(claims.values(), key=lambda c: c["epsilon"])
        parts.append(f"DP-SGD up to ({worst['epsilon']:.3g}, {worst['delta']:g}) over {len(claims)} worker(s)")
    return "; ".join(parts)


def workers_table(workers: list[dict[str, Any]]) -> str:
    if not workers:
        return "no workers yet"
    return table(("worker", "expert", "status", "last seen", "updates", "MB up", "MB down"),
                 [(w["worker_id"], w["specialty"], "revoked" if w.get("revoked") else w["status"],
                   when(w["last_seen"]), str(w["updates_sent"]), f"{w['bytes_up'] / 1e6:.2f}",
                   f"{w['bytes_down'] / 1e6:.2f}") for w in workers])


def choose_adapter(client: CoordinatorClient, args: argparse.Namespace, expert: str | None) -> Adapter:
    from gateway.local import choose_adapter as choose

    return choose(client, expert, args.strategy, json_object(args.strategy_config, "--strategy-config"))


def save(client: CoordinatorClient, args: argparse.Namespace) -> str:
    """Save what --save-gateway asks for; returns the line that says what was saved."""
    from gateway.local import load_matching_base, output_format, save_adapter

    fmt = output_format(args.save_gateway, args.format)
    adapter = choose_adapter(client, args, args.expert)
    save_adapter(adapter, args.save_gateway, fmt, overwrite=args.overwrite,
                 load_base=lambda: load_matching_base(adapter, args.base_model, args.use_huggingface))
    what = f"expert {args.expert}" if args.expert else f"gateway ({adapter.info.get('strategy')})"
    shape = "full-parameter" if adapter.lora is None else f"rank {adapter.lora['rank']}"
    return f"saved {what}, {shape}, as {fmt} to {args.save_gateway}"


def generate(client: CoordinatorClient, args: argparse.Namespace) -> str:
    from gateway.local import answer, load_matching_base

    expert = args.expert
    if expert is None and not args.strategy:
        try:
            routed = client.gateway.route(args.generate)
        except NotFound:  # no routing profiles yet: the gateway answers
            routed = {"expert": None, "confidence": 0.0}
        expert = routed["expert"]
        print(f"[routed to {expert or 'the gateway'} (confidence {routed['confidence']:.2f})]", file=sys.stderr)
    adapter = choose_adapter(client, args, expert)
    base = load_matching_base(adapter, args.base_model, args.use_huggingface)
    return answer(adapter, base, args.generate, args.max_new_tokens)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args, logging.WARNING)  # stdout is the answer; only problems go to stderr
    from protocol.client import CoordinatorClient, RetryPolicy

    try:
        client = CoordinatorClient(check_coordinator_url(args.coordinator_url), timeout=(5.0, 300.0),
                                   retry=RetryPolicy(attempts=2), use_proxy=args.use_proxy,
                                   token=args.token, ca_cert=args.ca_cert)
        for worker_id in args.revoke_worker:
            info = client.workers.revoke(worker_id)
            print(f"revoked worker {worker_id} ({info['tokens']} token(s)); it cannot register again")
        if args.list_experts:
            print(experts_table(client.experts.list()))
            print()
            print(workers_table(client.workers.list()))
        if args.save_gateway:
            print(save(client, args))
        if args.generate:
            print(generate(client, args))
        if not (args.list_experts or args.save_gateway or args.generate or args.revoke_worker):
            print(json.dumps(client.gateway.info(), indent=2))
    except (FedMoEError, GatewayError, ValueError, OSError) as exc:
        return report_error(args, exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
