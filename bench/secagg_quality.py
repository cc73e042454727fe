#!/usr/bin/env python3
"""Secure aggregation's cost in learning: held-out loss with it and with plain FedBuff, same optimiser steps.

One expert (DS-1000 pandas), K workers each on its own shard, synchronous rounds in one process with
real trainers (``bench.realdata.Lab``, LoRA r=8 on every projection). Both arms start from the same
adapter with the same seeds; each round every worker takes ``--steps`` AdamW steps from the expert's
weights and sends its delta:

- ``plain``: FedBuff over the round's K updates (``coordinator.aggregation``: sample-weighted mean, staleness 0);
- ``secagg``: the same K deltas through the whole protocol (``privacy.secagg``: cohort, keys, sealed
  Shamir shares, masked inputs quantised to Z_2^32, unmasking), whose sample-weighted mean is applied.

Secure aggregation should equal plain FedBuff up to quantisation: the table shows held-out loss (with and
without the end-of-answer token) after the same steps, the largest coordinate error the quantisation put
in a round's mean (against the exact mean of the same deltas) relative to that mean's largest value,
and how far the two arms' final adapters drifted apart.

    python -m bench.secagg_quality            # smollm2-135m, 4 workers x 4 rounds x 2 steps (~10 min)
    python -m bench.secagg_quality --quick    # tiny-qwen2 smoke run, seconds

Results in bench/results/secagg_quality.json (commit and load average stamped).
"""
from __future__ import annotations

import sys
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import Bench, Run
from bench.common import format_table
from bench.realdata import REAL_MODEL, SMOKE_MODEL, Lab, ds1000_domains, loss_pair, shards
from coordinator.aggregation import AGGREGATORS, AggregationParams, Update
from privacy.secagg.aggregator import SecAggSettings, SecureAggregator
from privacy.secagg.journal import CohortJournal
from privacy.secagg.session import CohortSession
from privacy.secagg.vector import flatten, unflatten
from protocol.cli import option
from protocol.tensors import StateDict, manifest_of

DOMAIN = "pandas_expert"


def secure_mean(deltas: list[StateDict], samples: list[int], folder: Path, round_index: int) -> tuple[StateDict, float]:
    """The sample-weighted mean of ``deltas`` as the aggregator learns it; and its largest quantisation error,
    relative to the exact mean's largest value."""
    manifest = manifest_of(deltas[0])
    flats = [flatten(d, manifest) for d in deltas]
    workers = [f"w{i}" for i in range(len(deltas))]
    aggregator = SecureAggregator(CohortJournal(folder / f"round{round_index}"),
                                  SecAggSettings(cohort_size=len(deltas)), lambda expert: flats[0].size)
    sessions = [CohortSession(aggregator, DOMAIN, w) for w in workers]
    for _ in range(4):
        for session in sessions:
            session.advance()
    for session, flat, n in zip(sessions, flats, samples):
        session.submit(flat, n, {"base_version": round_index}, rounding_seed=int.from_bytes(os.urandom(4), "little"))
    for session in sessions:
        session.advance()
    [ready] = aggregator.ready()
    aggregator.applied(ready.config.cohort_id)
    exact = sum(n * f for n, f in zip(samples, flats)) / sum(samples)
    error = float(np.abs(ready.mean - exact).max() / max(np.abs(exact).max(), 1e-30))
    return unflatten(ready.mean, manifest), error


def run_arm(lab: Lab, arm: str, worker_shards: list[list[Any]], rounds: int, steps: int, seed: int,
            folder: Path) -> dict[str, Any]:
    trainers = [lab.trainer(shard, seed + i) for i, shard in enumerate(worker_shards)]
    weights = trainers[0].adapter_state()
    errors = []
    for round_index in range(rounds):
        deltas, samples = [], []
        for trainer in trainers:
            trainer.load_adapter_state(weights)
            lab.train(trainer, steps)
            after = trainer.adapter_state()
            deltas.append({k: after[k] - weights[k] for k in weights})
            samples.append(steps * lab.batch_size)
        if arm == "plain":
            updates = [Update(d, n, 0) for d, n in zip(deltas, samples)]
            weights = AGGREGATORS["fedbuff"]({k: v.clone() for k, v in weights.items()}, updates, AggregationParams())
        else:
            mean, error = secure_mean(deltas, samples, folder, round_index)
            errors.append(error)
            weights = {k: weights[k] + mean[k] for k in weights}
    return {"weights": weights, "lora": trainers[0].lora_config, "quantisation_error": errors,
            "optimiser_steps": rounds * steps * len(trainers)}


@dataclass(frozen=True)
class Settings:
    model: str = option(REAL_MODEL, "base model")
    heldout_limit: int | None = option(None, "score only the first N held-out problems (default: all)", type=int,
                                       metavar="N")
    workers: int = option(4, "K: workers, all in one cohort each round")
    rounds: int = option(4, "rounds")
    steps: int = option(2, "AdamW steps per worker per round")
    seed: int = option(0, "training seed")

    def __post_init__(self) -> None:
        if min(self.workers - 1, self.rounds, self.steps) < 1:
            raise ValueError("--workers must be at least 2, --rounds and --steps at least 1")


def run(s: Settings, ctx: Run) -> int:
    logging.getLogger("privacy").setLevel(logging.WARNING)  # a line per round change of every cohort
    domain = next(d for d in ds1000_domains() if d.name == DOMAIN)
    lab = Lab(s.model)
    heldout = list(domain.heldout[:s.heldout_limit] if s.heldout_limit else domain.heldout)
    worker_shards = shards(domain.train, s.workers)
    arms: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-secagg-quality-") as folder:
        for arm in ("plain", "secagg"):
            arms[arm] = run_arm(lab, arm, worker_shards, s.rounds, s.steps, s.seed, Path(folder))
    base = loss_pair(lab.losses(heldout))
    for result in arms.values():
        result["heldout"] = loss_pair(lab.losses(heldout, result["weights"], result["lora"]))
    drift = max(float((arms["plain"]["weights"][k] - arms["secagg"]["weights"][k]).abs().max())
                for k in arms["plain"]["weights"])
    scale = max(float(v.abs().max()) for v in arms["plain"]["weights"].values())
    rows = [[arm, r["optimiser_steps"], round(r["heldout"]["loss"], 4), round(r["heldout"]["loss_without_end"], 4),
             max(r["quantisation_error"]) if r["quantisation_error"] else None] for arm, r in arms.items()]
    print(format_table(["arm", "optimiser steps", "held-out loss", "without end token", "max rel. quant. error"], rows))
    print(f"base model: held-out loss {base['loss']:.4f}; final adapters differ by at most {drift:.3g} "
          f"(largest weight {scale:.3g})")
    ctx.write({
        "bench": "secagg_quality", "model": lab.model_id, "domain": DOMAIN,
        "heldout_examples": len(heldout), "workers": s.workers, "rounds": s.rounds, "steps": s.steps,
        "seed": s.seed, "base_heldout": base, "final_weight_drift": drift, "largest_weight": scale,
        "arms": {arm: {k: v for k, v in r.items() if k not in ("weights", "lora")} for arm, r in arms.items()},
        "compute": lab.compute.as_dict(), "wall_seconds": ctx.seconds()})
    return 0


BENCH = Bench("secagg_quality", tags=("privacy", "learning"), settings=Settings, run=run, cores=1,
              quick={"model": SMOKE_MODEL, "heldout_limit": 8})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
