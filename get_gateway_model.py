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
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Light imports only: --help and flag errors must not wait for torch (the work below imports it).
from gateway.choices import MERGE_NAMES
from gateway.errors import GatewayError
from protocol.cli import add_common_flags, check_coordinator_url, report_error, setup_logging
from protocol.errors import FedMoEError, NotFound
from protocol.files import write_atomically

if TYPE_CHECKING:
    from gateway.download import Adapter
    from protocol.client import CoordinatorClient

DEFAULT_SAVE_PATH = Path("gateway_model.npz")
FILE_FORMATS = {".npz": "npz", ".safetensors": "safetensors"}
FORMATS = ("npz", "safetensors", "peft", "merged")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--coordinator-url", default="http://127.0.0.1:5000",
                   help="coordinator address (default: %(default)s)")
    p.add_argument("--list-experts", action="store_true", help="print a table of experts")
    p.add_argument("--save-gateway", metavar="PATH", type=Path, nargs="?", const=DEFAULT_SAVE_PATH,
                   help="save the gateway (or --expert) to PATH: a file for npz/safetensors, a directory for "
                        f"peft/merged (no PATH: {DEFAULT_SAVE_PATH} in the current directory)")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="npz, safetensors (default: from PATH's extension), peft (adapter directory for "
                        "PeftModel.from_pretrained) or merged (full model directory)")
    p.add_argument("--expert", metavar="NAME", help="use this expert instead of the gateway")
    p.add_argument("--strategy", choices=MERGE_NAMES, default=None,
                   help="merge the experts here with this strategy instead of using the coordinator's gateway")
    p.add_argument("--strategy-config", default="{}", metavar="JSON", help='options, e.g. \'{"density": 0.3}\'')
    p.add_argument("--generate", metavar="PROMPT",
                   help="answer PROMPT locally with the expert the coordinator routes it to (or the gateway)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="length of a --generate answer")
    p.add_argument("--base-model", default=None,
                   help="base model for --format merged / --generate (default: the one the experts were "
                        "trained from, e.g. tiny-qwen2 or a hub id); a local directory works too")
    p.add_argument("--use-huggingface", action="store_true", help="load --base-model from the Hugging Face hub")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--use-proxy", action="store_true", help="honour HTTP(S)_PROXY for the coordinator")
    p.add_argument("--token", default=None,
                   help="admin token (default: $FEDMOE_TOKEN, or found automatically when the coordinator runs "
                        "on this machine)")
    p.add_argument("--ca-cert", type=Path, default=None,
                   help="PEM certificate (or CA) to trust for an https:// coordinator with a private certificate")
    p.add_argument("--revoke-worker", metavar="WORKER_ID", action="append", default=[],
                   help="admin: revoke a worker's tokens; it cannot register again (repeatable)")
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
    return table(("name", "version", "updates", "samples", "rank", "last loss", "last update"),
                 [(e["name"], str(e["version"]), str(e["updates_applied"]), str(e["samples_seen"]),
                   "full" if e.get("kind") == "full" else str(e["lora"]["rank"]),
                   "-" if e.get("last_train_loss") is None else f"{e['last_train_loss']:.4f}", when(e["updated_at"]))
                  for e in experts])


def workers_table(workers: list[dict[str, Any]]) -> str:
    if not workers:
        return "no workers yet"
    return table(("worker", "expert", "status", "last seen", "updates", "MB up", "MB down"),
                 [(w["worker_id"], w["specialty"], "revoked" if w.get("revoked") else w["status"],
                   when(w["last_seen"]), str(w["updates_sent"]), f"{w['bytes_up'] / 1e6:.2f}",
                   f"{w['bytes_down'] / 1e6:.2f}") for w in workers])


def choose_adapter(client: CoordinatorClient, args: argparse.Namespace, expert: str | None) -> Adapter:
    from gateway.download import fetch_expert, fetch_gateway, merge_experts
    from protocol.schemas import parse_json_flag

    if expert:
        return fetch_expert(client, expert)
    if args.strategy:
        return merge_experts(client, args.strategy, parse_json_flag(args.strategy_config, "--strategy-config"))
    return fetch_gateway(client)


def output_format(args: argparse.Namespace) -> str:
    if args.format:
        return args.format
    fmt = FILE_FORMATS.get(args.save_gateway.suffix.lower())
    if fmt is None:
        raise ValueError(f"--save-gateway: cannot tell the format from {str(args.save_gateway)!r}; use a .npz or "
                         f".safetensors name, or --format {{{','.join(FORMATS)}}}")
    return fmt


def save(adapter: Adapter, path: Path, fmt: str, args: argparse.Namespace) -> None:
    if not path.parent.is_dir():
        raise ValueError(f"--save-gateway: directory {str(path.parent)!r} does not exist")
    if fmt in FILE_FORMATS.values():
        from gateway.files import npz_bytes, safetensors_bytes

        if path.exists() and not args.overwrite:
            raise ValueError(f"--save-gateway: {str(path)!r} exists; pass --overwrite to replace it")
        write_atomically(path, (npz_bytes if fmt == "npz" else safetensors_bytes)(adapter.tensors, adapter.info))
        return
    from gateway.export import save_merged_model, save_peft_adapter

    if adapter.lora is None:  # a full-parameter expert, or a gateway averaged from them
        save_full(adapter, path, fmt, args)
    elif fmt == "peft":
        save_peft_adapter(path, adapter.tensors, adapter.lora, adapter.base_model["id"], overwrite=args.overwrite)
    else:
        base = load_base(adapter, args)
        save_merged_model(path, base.model, base.tokenizer, adapter.tensors, adapter.lora, overwrite=args.overwrite)


def save_full(adapter: Adapter, path: Path, fmt: str, args: argparse.Namespace) -> None:
    from gateway.full import save_full_model

    if fmt == "peft":
        raise ValueError("--format peft: this is a full-parameter model (every weight, no LoRA factors), not a "
                         "PEFT adapter; use --format merged for a model directory, or a .safetensors/.npz file")
    base = load_base(adapter, args)
    save_full_model(path, base.model, base.tokenizer, adapter.tensors, overwrite=args.overwrite)


def load_base(adapter: Adapter, args: argparse.Namespace):
    from worker.models import ModelLoadError, load_base_model

    try:
        base = load_base_model(args.base_model or adapter.base_model["id"], use_huggingface=args.use_huggingface)
    except ModelLoadError as exc:
        raise ValueError(f"{exc} (or pass --base-model)") from None
    if base.fingerprint != adapter.base_model["fingerprint"]:
        raise ValueError(f"base model {base.model_id!r} is not the one the experts were trained from "
                         f"({adapter.base_model['id']!r}); fix --base-model")
    return base


def generate(client: CoordinatorClient, args: argparse.Namespace) -> str:
    from gateway.generate import generate as answer

    expert = args.expert
    if expert is None and not args.strategy:
        try:
            routed = client.route(args.generate)
        except NotFound:  # no routing profiles yet: the gateway answers
            routed = {"expert": None, "confidence": 0.0}
        expert = routed["expert"]
        print(f"[routed to {expert or 'the gateway'} (confidence {routed['confidence']:.2f})]", file=sys.stderr)
    adapter = choose_adapter(client, args, expert)
    base = load_base(adapter, args)
    if adapter.lora is None:  # full-parameter weights: answer with the model holding them
        from gateway.full import with_full_weights

        return answer(with_full_weights(base.model, adapter.tensors), base.tokenizer, args.generate,
                      max_new_tokens=args.max_new_tokens)
    return answer(base.model, base.tokenizer, args.generate, adapter.tensors, adapter.lora, args.max_new_tokens)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args, logging.WARNING)  # stdout is the answer; only problems go to stderr
    from protocol.client import CoordinatorClient, RetryPolicy

    try:
        client = CoordinatorClient(check_coordinator_url(args.coordinator_url), timeout=(5.0, 300.0),
                                   retry=RetryPolicy(attempts=2), use_proxy=args.use_proxy,
                                   token=args.token, ca_cert=args.ca_cert)
        for worker_id in args.revoke_worker:
            info = client.revoke_worker(worker_id)
            print(f"revoked worker {worker_id} ({info['tokens']} token(s)); it cannot register again")
        if args.list_experts:
            print(experts_table(client.list_experts()))
            print()
            print(workers_table(client.list_workers()))
        if args.save_gateway:
            fmt = output_format(args)
            adapter = choose_adapter(client, args, args.expert)
            save(adapter, args.save_gateway, fmt, args)
            what = f"expert {args.expert}" if args.expert else f"gateway ({adapter.info.get('strategy')})"
            shape = "full-parameter" if adapter.lora is None else f"rank {adapter.lora['rank']}"
            print(f"saved {what}, {shape}, as {fmt} to {args.save_gateway}")
        if args.generate:
            print(generate(client, args))
        if not (args.list_experts or args.save_gateway or args.generate or args.revoke_worker):
            print(json.dumps(client.gateway_info(), indent=2))
    except (FedMoEError, GatewayError, ValueError, OSError) as exc:
        return report_error(args, exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
