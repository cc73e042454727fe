#!/usr/bin/env python3
"""Load benchmark: 100 simulated workers push real-sized compressed updates to one coordinator on loopback.

The coordinator is a separate real process (run_coordinator.py, durable data dir on disk).
Each simulated worker is a thread with its own ``CoordinatorClient`` (the workers' real client, with
its retries): it registers, then pushes ``--rounds`` updates to its expert as fast as the server takes
them. An update is what a Qwen2-0.5B worker with LoRA r=8 on all seven projections sends: the
manifest shapes come from the model's config (no download), the deltas are random tensors of those
shapes, encoded with a real codec from compression/ (int8 by default, ~4.7 MB per push). Payloads
are encoded before the clock starts, so the latencies are the server's, not the encoder's.

At the end every acknowledged update_id is looked up (lost = acknowledged but unknown) and each
expert's updates_applied + pending_updates and samples_seen are compared with the updates the
server knows (duplicated = counted more than once). Peak RSS is the kernel's high-water mark
(VmHWM in /proc) of the coordinator's processes.

    python -m bench.load                  # 100 workers x 2 pushes of Qwen2-0.5B LoRA r=8, int8, ~1-2 min
    python -m bench.load --quick          # 8 workers, tiny-qwen2 shapes, K=2, ~10 s (the smoke test)
    python -m bench.load --codec topk+int8 --rounds 5

Table on stdout, progress on stderr, results in bench/results/load.json.
"""
from __future__ import annotations

import argparse
import logging
import math
import random
import re
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS_DIR, configure_logging, coordinator_process, format_table, write_json_atomic
from compression import make_codec
from compression.wire import encode_update
from protocol.client import CoordinatorClient
from protocol.errors import FedMoEError
from protocol.tensors import Manifest

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench.load")
RESULTS = RESULTS_DIR / "load.json"
FINGERPRINT = "10ad" * 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Shapes only: Qwen2-0.5B's config.json (hidden 896, MLP 4864, 24 layers, 14 heads, 2 KV heads of 64)
# and the offline tiny-qwen2 preset (worker/models.py).
MODELS: dict[str, dict[str, int]] = {
    "qwen2-0.5b": {"hidden": 896, "intermediate": 4864, "layers": 24, "heads": 14, "kv_heads": 2},
    "tiny-qwen2": {"hidden": 128, "intermediate": 344, "layers": 2, "heads": 4, "kv_heads": 2},
}


def lora_manifest(model: str, rank: int) -> Manifest:
    """PEFT's tensor names and shapes for LoRA on all seven projections of a Qwen2 model."""
    c = MODELS[model]
    hidden, kv = c["hidden"], c["kv_heads"] * (c["hidden"] // c["heads"])
    dims = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
            "gate_proj": (hidden, c["intermediate"]), "up_proj": (hidden, c["intermediate"]),
            "down_proj": (c["intermediate"], hidden)}
    manifest = []
    for layer in range(c["layers"]):
        for proj in PROJECTIONS:
            part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            d_in, d_out = dims[proj]
            manifest += [(f"{key}.lora_A.weight", (rank, d_in)), (f"{key}.lora_B.weight", (d_out, rank))]
    return sorted(manifest)


def random_tensors(manifest: Manifest, seed: int, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * scale for name, shape in manifest}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def peak_rss_bytes(pid: int) -> dict[int, int]:
    """VmHWM of a process and its children, by pid (the kernel's own peak, no sampling needed)."""
    pids = [pid]
    try:
        pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    peaks = {}
    for p in pids:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        if m := re.search(r"^VmHWM:\s+(\d+) kB", status, re.M):
            peaks[p] = int(m.group(1)) * 1024
    return peaks


@dataclass(frozen=True)
class Settings:
    workers: int = 100
    rounds: int = 2
    experts: int = 4
    model: str = "qwen2-0.5b"
    rank: int = 8
    codec: str = "int8"
    aggregation: str = "fedbuff"
    buffer_size: int = 10
    seed: int = 0


@dataclass
class Pushed:
    update_id: str
    expert: str
    num_samples: int
    seconds: float
    status: str  # "accepted" (202), "duplicate" (200), or the error


def simulated_worker(url: str, index: int, expert: str, payloads: list[bytes], settings: Settings,
                     start: threading.Event, results: list[Pushed], lock: threading.Lock) -> None:
    client = CoordinatorClient(url, timeout=(10.0, 300.0))
    worker_id = f"load-worker-{index}"
    base = {"id": settings.model, "fingerprint": FINGERPRINT}
    version = client.register_worker(worker_id, expert, base, sync_interval=10.0)["expert"]["version"]
    start.wait()
    for n, body in enumerate(payloads):
        meta = {"update_id": f"{worker_id}:{n}", "base_version": version, "num_samples": 1 + (index * 7 + n) % 50,
                "codec": settings.codec, "codec_config": {}, "worker_id": worker_id, "train_loss": 1.0}
        began = time.perf_counter()
        try:
            answer = client.push_update(expert, body, meta)
            status = "accepted"
            version = answer["expert_version"]
        except FedMoEError as exc:
            status = f"{type(exc).__name__}: {exc}"
        with lock:
            results.append(Pushed(meta["update_id"], expert, meta["num_samples"], time.perf_counter() - began, status))
    client.close()


def verify(url: str, pushed: list[Pushed], experts: list[str]) -> dict[str, Any]:
    """lost: acknowledged ids the server does not know; duplicated: updates counted more than once."""
    client = CoordinatorClient(url)
    known: dict[str, dict[str, Any]] = {}
    lost = 0
    for p in pushed:
        try:
            known[p.update_id] = client.update_status(p.update_id)
        except FedMoEError:
            lost += p.status == "accepted"
    duplicated = 0
    for name in experts:
        info = client.expert(name)
        mine = [p for p in pushed if p.expert == name and p.update_id in known]
        applied = [p for p in mine if known[p.update_id]["status"] == "applied"]
        duplicated += max(0, info["updates_applied"] + info["pending_updates"] - len(mine))
        if info["samples_seen"] != sum(p.num_samples for p in applied):
            duplicated += 1  # samples counted twice (or lost) even if the counts agree
    client.close()
    return {"lost": lost, "duplicated": duplicated, "known": len(known)}


def run(settings: Settings) -> dict[str, Any]:
    torch.set_num_threads(1)
    rng = random.Random(settings.seed)
    manifest = lora_manifest(settings.model, settings.rank)
    codec = make_codec(settings.codec, {})
    numel = sum(math.prod(shape) for _, shape in manifest)
    experts = [f"load_expert_{i}" for i in range(settings.experts)]
    log.info("encoding %d payloads of %d parameters with %s", settings.workers * settings.rounds, numel, settings.codec)
    started = time.perf_counter()
    payloads = [[encode_update(random_tensors(manifest, rng.randrange(2**31), 1e-3), manifest, codec, seed=r + 1)
                 for r in range(settings.rounds)] for _ in range(settings.workers)]
    encode_s = time.perf_counter() - started
    # on disk (durability included); its own process group, so that stopping it stops all it started
    with tempfile.TemporaryDirectory(prefix="fedmoe-load-") as data_dir, coordinator_process(
            Path(data_dir), "--aggregation", settings.aggregation, "--buffer-size", str(settings.buffer_size),
            "--threads", "16", new_session=True) as server:
        setup = CoordinatorClient(server.url)
        spec = {"lora": {"rank": settings.rank, "alpha": 2.0 * settings.rank, "target_modules": list(PROJECTIONS)},
                "base_model": {"id": settings.model, "fingerprint": FINGERPRINT}}
        for i, name in enumerate(experts):
            setup.create_expert(name, random_tensors(manifest, 10_000 + i, 0.01), spec)
        setup.close()
        start, lock, results = threading.Event(), threading.Lock(), []
        threads = [threading.Thread(target=simulated_worker, args=(
            server.url, i, experts[i % len(experts)], payloads[i], settings, start, results, lock))
            for i in range(settings.workers)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # let every worker register before the clock starts
        log.info("%d workers pushing", settings.workers)
        began = time.perf_counter()
        start.set()
        for t in threads:
            t.join()
        push_s = time.perf_counter() - began
        checked = verify(server.url, results, experts)
        peaks = peak_rss_bytes(server.pid)
    latencies = [p.seconds for p in results]
    errors = [p.status for p in results if p.status != "accepted"]
    body_bytes = sum(len(b) for w in payloads for b in w)
    return {
        "settings": settings.__dict__, "parameters_per_update": numel,
        "body_bytes_per_update": body_bytes // max(1, settings.workers * settings.rounds),
        "pushes": len(results), "acknowledged": len(results) - len(errors), "errors": errors[:20],
        "lost": checked["lost"], "duplicated": checked["duplicated"],
        "latency_s": {"p50": round(percentile(latencies, 50), 4), "p95": round(percentile(latencies, 95), 4),
                      "p99": round(percentile(latencies, 99), 4), "max": round(max(latencies), 4)},
        "pushes_per_s": round(len(results) / push_s, 2), "mb_per_s": round(body_bytes / push_s / 1e6, 1),
        "push_seconds": round(push_s, 2), "encode_seconds": round(encode_s, 2),
        "coordinator_peak_rss_mb": {"max_process": round(max(peaks.values()) / 2**20, 1),
                                    "sum_processes": round(sum(peaks.values()) / 2**20, 1),
                                    "processes": len(peaks)},
        "server_errors": [line.strip() for line in server.log if "unhandled error" in line][:20],
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Settings()
    p.add_argument("--workers", type=int, default=d.workers, help="simulated workers (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=d.rounds, help="pushes per worker (default: %(default)s)")
    p.add_argument("--experts", type=int, default=d.experts, help="experts the workers share (default: %(default)s)")
    p.add_argument("--model", choices=sorted(MODELS), default=d.model, help="shapes of the LoRA update")
    p.add_argument("--codec", default=d.codec, help="compression codec of the updates (default: %(default)s)")
    p.add_argument("--aggregation", choices=("fedasync", "fedbuff"), default=d.aggregation)
    p.add_argument("--buffer-size", type=int, default=d.buffer_size, help="fedbuff K (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="8 workers on tiny-qwen2 shapes, fedbuff K=2 (the smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS, help="results JSON (default: %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true")
    args, _ = p.parse_known_args(argv)  # run_all.py passes every benchmark the same flags
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.verbose)
    log.setLevel(logging.INFO)
    settings = Settings(workers=8 if args.quick else args.workers, rounds=args.rounds, experts=args.experts,
                        model="tiny-qwen2" if args.quick else args.model, codec=args.codec,
                        aggregation=args.aggregation, buffer_size=2 if args.quick else args.buffer_size)
    report = run(settings)
    write_json_atomic(args.out, report)
    lat = report["latency_s"]
    print(format_table(
        ["workers", "pushes", "MB/push", "lost", "dup", "p50 s", "p95 s", "p99 s", "pushes/s", "MB/s", "peak RSS MB"],
        [[settings.workers, report["pushes"], round(report["body_bytes_per_update"] / 1e6, 2), report["lost"],
          report["duplicated"], lat["p50"], lat["p95"], lat["p99"], report["pushes_per_s"], report["mb_per_s"],
          report["coordinator_peak_rss_mb"]["max_process"]]]))
    bad = report["lost"] or report["duplicated"] or report["errors"] or report["server_errors"]
    for line in report["errors"] + report["server_errors"]:
        print("ERROR:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
