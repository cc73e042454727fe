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

import statistics
import sys
import time
from bench.harness import Bench, Run
from protocol.cli import option
from dataclasses import dataclass
from typing import Any

from bench.common import format_table, running_coordinator
from bench.realdata import REAL_MODEL, SMOKE_MODEL, Lab, ds1000_domains, loss_pair, shards
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
            worker.joining.join()
            team.append(worker)
        for _ in range(rounds):
            for worker in team:
                worker.interval.add(worker.trainer.train_steps(steps))
                records.append(worker.sync())
        client = CoordinatorClient(url)
        weights, lora = client.experts.pull(DOMAIN).tensors, client.experts.get(DOMAIN)["lora"]
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


@dataclass(frozen=True)
class Settings:
    model: str = option(REAL_MODEL, "base model")
    workers: int = option(3, "workers of the expert")
    rounds: int = option(6, "syncs per worker")
    steps: int = option(2, "optimiser steps per worker per round")

    def __post_init__(self) -> None:
        if min(self.workers, self.rounds, self.steps) < 1:
            raise ValueError("--workers, --rounds and --steps must be at least 1")


def run(s: Settings, ctx: Run) -> int:
    lab = Lab(s.model, batch_size=4, max_seq_len=128)
    rows = [run_arm(lab, arm, s.workers, s.rounds, s.steps) for arm in ARMS]
    before = rows[0]
    for row in rows:
        row["loss_change_pct"] = 100 * (row["loss"] - before["loss"]) / before["loss"]
        row["bytes_per_sync_ratio"] = before["bytes_per_sync"] / row["bytes_per_sync"]
    ctx.write({"benchmark": "default_compression", "base_model": lab.model_id, "domain": DOMAIN,
               "workers": s.workers, "rounds": s.rounds, "steps": s.steps, "lr": lab.lr, "arms": rows})
    print(format_table(["arm", "push", "pull", "push kB/sync", "pull kB/sync", "diff pull kB", "kB/sync",
                        "held-out loss", "w/o end", "loss vs before"],
                       [[r["arm"], r["push_codec"], r["pull_codec"] or "full", round(r["push_bytes_mean"] / 1e3, 1),
                         round(r["pull_bytes_mean"] / 1e3, 1),
                         None if r["diff_pull_bytes_mean"] is None else round(r["diff_pull_bytes_mean"] / 1e3, 1),
                         round(r["bytes_per_sync"] / 1e3, 1), round(r["loss"], 4), round(r["loss_without_end"], 4),
                         f"{r['loss_change_pct']:+.2f}%"] for r in rows]))
    print(f"{lab.model_id}, {s.workers} workers x {s.rounds} rounds x {s.steps} steps; results in {ctx.out}")
    return 0


BENCH = Bench("default_compression", tags=("training", "learning"), settings=Settings, run=run, cores=1,
              quick={"model": SMOKE_MODEL, "rounds": 2})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
