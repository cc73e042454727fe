#!/usr/bin/env python3
"""The worker's compression defaults, before and after: bytes per sync and the expert's held-out loss.

Two arms run the same federated job with the same seeds:

- ``before``: the defaults until 2026-11-29, fp32 safetensors pushes and full-weight pulls;
- ``after``: the defaults now (worker.choices), int8 pushes with error feedback and int8 diff pulls
  (every tenth pull, and the first, full).

The job: ``--workers`` in-process workers of one expert (DS-1000 pandas, each on its own third of
``train/``) against a real coordinator on loopback with its default aggregation; ``--rounds`` rounds
in which each worker takes ``--steps`` optimiser steps (LoRA r8, batch 4 x 128) and syncs (push,
then pull). No final flush, so the expert holds what the codec delivered. Reported per arm: bytes
pushed and pulled per sync (the first pulls, when a worker holds nothing, are full weights in both
arms), and the held-out loss of the expert as the coordinator holds it on the held-out pandas
problems (per answer token, with and without the end-of-answer token).

    python -m bench.default_compression            # smollm2-135m (make smollm2); ~30 CPU minutes
    python -m bench.default_compression --quick    # tiny-qwen2 smoke run

Table on stdout, results in bench/results/default_compression.json (stamped with commit and load).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, format_table, running_coordinator, write_json_atomic
from bench.realdata import REAL_MODEL, SMOKE_MODEL, Lab, ds1000_domains, loss_pair, shards
from bench.worker_memory import git_head
from protocol.client import CoordinatorClient
from protocol.schemas import RAW_CODEC
from worker.encoding import CompressionSettings, PullSettings, UpdateEncoder
from worker.federation import FederatedWorker, SyncSettings

DOMAIN = "pandas_expert"


@dataclass(frozen=True)
class Arm:
    name: str
    push: CompressionSettings
    pull: PullSettings


ARMS = (Arm("before", CompressionSettings(RAW_CODEC), PullSettings(codec=None)),
        Arm("after", CompressionSettings(), PullSettings()))


def run_arm(lab: Lab, arm: Arm, workers: int, rounds: int, steps: int) -> dict[str, Any]:
    """One federated job under ``arm``'s codecs; its bytes per sync and the expert's held-out loss."""
    domain = next(d for d in ds1000_domains() if d.name == DOMAIN)
    records: list[dict[str, Any]] = []
    started = time.process_time()
    with running_coordinator() as url:
        team = []
        for i, shard in enumerate(shards(domain.train, workers)):
            trainer = lab.trainer(shard, seed=i)
            spec = {"lora": trainer.lora_config,
                    "base_model": {"id": lab.base.model_id, "fingerprint": lab.base.fingerprint}}
            worker = FederatedWorker(SyncSettings(specialty=DOMAIN, worker_id=f"w{i}"), CoordinatorClient(url),
                                     trainer, spec, encoder=UpdateEncoder(arm.push), pull=arm.pull)
            worker.join()
            team.append(worker)
        for _ in range(rounds):
            for worker in team:
                worker.interval.add(worker.trainer.train_steps(steps))
                records.append(worker.sync())
        client = CoordinatorClient(url)
        weights, lora = client.pull_weights(DOMAIN).tensors, client.expert(DOMAIN)["lora"]
        client.close()
    assert weights is not None
    return {"arm": arm.name, "push_codec": arm.push.codec, "pull_codec": arm.pull.codec,
            **sync_bytes(records), **loss_pair(lab.losses(domain.heldout, weights, lora)),
            "cpu_seconds": round(time.process_time() - started, 1),
            "syncs": [{k: r.get(k) for k in ("worker_id", "codec", "bytes_sent", "relative_error", "pull_codec",
                                             "bytes_down")} for r in records]}


def sync_bytes(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean bytes a sync pushed and pulled; the pulls of workers that already held a version apart."""
    pushes = [r["bytes_sent"] for r in records if r.get("bytes_sent")]
    pulls = [r["bytes_down"] for r in records if r.get("pulled")]
    later = [r["bytes_down"] for r in records if r.get("pulled") and r.get("pull_codec")]
    return {"syncs": len(records), "push_bytes_mean": statistics.fmean(pushes) if pushes else 0.0,
            "pull_bytes_mean": statistics.fmean(pulls) if pulls else 0.0,
            "diff_pull_bytes_mean": statistics.fmean(later) if later else None, "diff_pulls": len(later),
            "bytes_per_sync": (sum(pushes) + sum(pulls)) / len(records) if records else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny-qwen2, 2 rounds: a smoke run")
    p.add_argument("--workers", type=int, default=3, help="workers of the expert (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=6, help="syncs per worker (default: %(default)s)")
    p.add_argument("--steps", type=int, default=2, help="optimiser steps per worker per round (default: %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "default_compression.json",
                   help="results JSON (default: %(default)s)")
    args = p.parse_args(argv)
    if min(args.workers, args.rounds, args.steps) < 1:
        p.error("--workers, --rounds and --steps must be at least 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    rounds = 2 if args.quick else args.rounds
    commit, lab = git_head(), Lab(SMOKE_MODEL if args.quick else REAL_MODEL, batch_size=4, max_seq_len=128)
    rows = [run_arm(lab, arm, args.workers, rounds, args.steps) for arm in ARMS]
    before = rows[0]
    for row in rows:
        row["loss_change_pct"] = 100 * (row["loss"] - before["loss"]) / before["loss"]
        row["bytes_per_sync_ratio"] = before["bytes_per_sync"] / row["bytes_per_sync"]
    write_json_atomic(args.out, {"benchmark": "default_compression", "commit": commit, "base_model": lab.model_id,
                                 "domain": DOMAIN, "workers": args.workers, "rounds": rounds, "steps": args.steps,
                                 "lr": lab.lr, "load_average_at_end": [round(x, 1) for x in os.getloadavg()],
                                 "arms": rows})
    print(format_table(["arm", "push", "pull", "push kB/sync", "pull kB/sync", "diff pull kB", "kB/sync",
                        "held-out loss", "w/o end", "loss vs before"],
                       [[r["arm"], r["push_codec"], r["pull_codec"] or "full", round(r["push_bytes_mean"] / 1e3, 1),
                         round(r["pull_bytes_mean"] / 1e3, 1),
                         None if r["diff_pull_bytes_mean"] is None else round(r["diff_pull_bytes_mean"] / 1e3, 1),
                         round(r["bytes_per_sync"] / 1e3, 1), round(r["loss"], 4), round(r["loss_without_end"], 4),
                         f"{r['loss_change_pct']:+.2f}%"] for r in rows]))
    print(f"{lab.model_id}, {args.workers} workers x {rounds} rounds x {args.steps} steps; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
