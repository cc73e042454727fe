#!/usr/bin/env python3
"""A whole federation on one machine: a coordinator, one worker per sample domain, then a loss table.

Runs on the offline tiny-qwen2 preset, so it needs no model hub. Everything it
writes goes under demo-runs/<timestamp>/ (logs, per-sync results, the gateway).

  python scripts/demo.py                  # ~2 minutes of training
  python scripts/demo.py --duration 30    # a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# One torch thread for the evaluation here: on 2 busy cores, 2-thread torch was measured 4-15x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench.plots import plot_expert_losses, read_results  # noqa: E402
from protocol.client import CoordinatorClient  # noqa: E402
from protocol.tensors import loads  # noqa: E402

SPECIALTIES = ("python_expert", "sql_expert", "docs_expert")
LISTENING = re.compile(rb"listening on (http://[\d.]+:\d+)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=120, help="seconds each worker trains (default: %(default)s)")
    p.add_argument("--sync-interval", type=float, default=10, help="seconds between syncs (default: %(default)s)")
    p.add_argument("--compression", default="safetensors", help="update codec for the workers (default: %(default)s)")
    p.add_argument("--compression-config", default="{}", help="codec options as JSON (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="run directory (default: demo-runs/<timestamp>)")
    return p.parse_args()


def child_env() -> dict[str, str]:
    # Three workers share two cores: one thread each avoids oversubscription.
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}


def start_coordinator(run: Path) -> tuple[subprocess.Popen, str]:
    log = open(run / "coordinator.log", "wb")
    proc = subprocess.Popen([sys.executable, str(ROOT / "run_coordinator.py"), "--host", "127.0.0.1",
                             "--port", "0", "--data-dir", str(run / "coordinator-data"),
                             "--gateway-interval", "0"],  # the losses table scores the newest gateway
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        log.write(line)
        if m := LISTENING.search(line):
            _drain(proc, log)
            return proc, m.group(1).decode()
        if time.monotonic() > deadline:
            break
    raise SystemExit(f"the coordinator did not start; see {run / 'coordinator.log'}")


def _drain(proc: subprocess.Popen, log) -> None:
    def copy() -> None:
        for line in proc.stdout:
            log.write(line)
            log.flush()

    threading.Thread(target=copy, daemon=True).start()


def start_worker(run: Path, url: str, specialty: str, args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "run_worker.py"), "--coordinator-url", url, "--specialty", specialty,
           "--worker-id", f"demo-{specialty}", "--base-model", "tiny-qwen2",
           "--duration", str(args.duration), "--sync-interval", str(args.sync_interval),
           "--compression", args.compression, "--compression-config", args.compression_config,
           "--results", str(run / f"{specialty}.results.jsonl"),
           "--state-dir", str(run / f"{specialty}.state")]
    return subprocess.Popen(cmd, env=child_env(), stdout=open(run / f"{specialty}.log", "wb"),
                            stderr=subprocess.STDOUT)


def evaluate(client: CoordinatorClient) -> dict[str, dict[str, float]]:
    """Held-out loss per domain of the base model, each expert, the gateway and the router."""
    import warnings

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    from worker.data import load_examples, sample_dataset_path, split_examples
    from worker.evaluation import adapter_loss
    from worker.models import load_base_model

    base = load_base_model("tiny-qwen2")
    heldout = {s: split_examples(load_examples(sample_dataset_path(s)))[1] for s in SPECIALTIES}
    experts = {e["name"]: e for e in client.list_experts()}
    models = {"base model": (None, None)}
    for name in SPECIALTIES:
        models[name] = (client.pull_weights(name).tensors, experts[name]["lora"])
    models["gateway"] = (loads(client.gateway_weights("safetensors")), client.gateway_info()["lora"])
    losses = {label: {d: adapter_loss(base, heldout[d], adapter, lora) for d in SPECIALTIES}
              for label, (adapter, lora) in models.items()}
    # The router: each held-out prompt answered by the expert (or gateway) the coordinator picks;
    # a domain's loss is the example-weighted mean over the groups of prompts sent to each target.
    losses["routed"] = {}
    for d in SPECIALTIES:
        groups: dict[str, list] = {}
        for example in heldout[d]:
            groups.setdefault(client.route(example.prompt)["target"], []).append(example)
        losses["routed"][d] = sum(len(g) * adapter_loss(base, g, *models[t]) for t, g in groups.items()) / len(heldout[d])
    return losses


def print_table(losses: dict[str, dict[str, float]], versions: dict[str, int]) -> None:
    print("\nheld-out loss per domain (lower is better)\n")
    print(f"{'model':<16}" + "".join(f"{d:>15}" for d in SPECIALTIES))
    for label, row in losses.items():
        suffix = f" v{versions[label]}" if label in versions else ""
        print(f"{label + suffix:<16}" + "".join(f"{row[d]:>15.4f}" for d in SPECIALTIES))


def main() -> int:
    args = parse_args()
    run = args.out or ROOT / "demo-runs" / time.strftime("%Y%m%d-%H%M%S")
    run.mkdir(parents=True, exist_ok=True)
    coordinator, url = start_coordinator(run)
    print(f"coordinator at {url}; logs in {run}")
    try:
        workers = [start_worker(run, url, s, args) for s in SPECIALTIES]
        print(f"3 workers training on tiny-qwen2 for {args.duration:.0f} s "
              f"(sync every {args.sync_interval:.0f} s)...")
        codes = [w.wait() for w in workers]
        if any(codes):
            print(f"a worker failed (exit codes {codes}); see {run}/*.log", file=sys.stderr)
            return 1
        subprocess.run([sys.executable, str(ROOT / "get_gateway_model.py"), "--coordinator-url", url,
                        "--list-experts"], env=child_env(), check=True)
        subprocess.run([sys.executable, str(ROOT / "get_gateway_model.py"), "--coordinator-url", url,
                        "--save-gateway", str(run / "gateway_model.npz")], env=child_env(), check=True)
        client = CoordinatorClient(url)
        versions = {e["name"]: e["version"] for e in client.list_experts()}
        losses = evaluate(client)
        print_table(losses, versions)
        (run / "losses.json").write_text(json.dumps(losses, indent=2))
        plot = plot_expert_losses({s: read_results(run / f"{s}.results.jsonl") for s in SPECIALTIES},
                                  run / "train_loss.png", title="demo: train loss per expert")
        print(f"\nwrote {run / 'losses.json'}, {plot} and {run / 'gateway_model.npz'}")
    finally:
        coordinator.terminate()
        coordinator.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
