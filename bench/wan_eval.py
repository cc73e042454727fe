"""bench.wan's scoring, off the clock: held-out loss of the versions each run kept, the targets, the summary.

Targets (issue 35): the best baseline's final held-out loss, and 90% of its gain from the start. The baselines are
the modes without relays (flat at each swept sync interval, flat with a fixed codec, Flower's FedAvg at each round
length); the best one is the baseline mode whose final loss (its last version's, the median over its runs) is lowest.
Every run's time to a target is the time of its first version at or below it (``first_reaching``: exact, whatever
was sampled before), and its steps to it the optimiser steps per worker trained by then (``steps_at``). A mode's figures are the median over its runs with their range; its speed-up is the fastest
baseline mode's median time over its own.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from bench.common import sample_suite
from bench.wan_setup import SPECIALTY, Settings

Loss = Callable[[dict[str, Any]], float]


def scorer(s: Settings) -> Loss:
    """Held-out loss of a version's weights (cached in the version as ``heldout_loss``), on the expert's held-out
    split with the mode's batch settings; one torch thread (the scoring runs beside nothing of the bench's)."""
    import torch
    from safetensors.torch import load_file

    from models.loading import load_base_model
    from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

    torch.set_num_threads(1)
    domain = next(d for d in sample_suite().domains if d.name == SPECIALTY)
    heldout = list(domain.heldout[:s.heldout])
    trainer = LoraTrainer(load_base_model(s.base_model), LoraSettings(),
                          TrainSettings(batch_size=s.batch_size, max_seq_len=s.max_seq_len), list(domain.train))

    def loss(v: dict[str, Any]) -> float:
        if "heldout_loss" not in v:
            trainer.load_adapter_state(load_file(v["file"]))
            v["heldout_loss"] = round(trainer.eval_loss(heldout, batch_size=8), 4)
        return float(v["heldout_loss"])

    return loss


def sample(versions: Sequence[dict[str, Any]], k: int, loss: Loss) -> None:
    """Score at most ``k`` versions evenly spaced, the first and last always (0: every version)."""
    n = len(versions)
    picks = range(n) if not k or n <= k else sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})
    for i in picks:
        loss(versions[i])


def first_reaching(versions: list[dict[str, Any]], goal: float, loss: Loss) -> int | None:
    """Index of the first version whose held-out loss is at or below ``goal`` (None: none is), evaluating with
    ``loss`` only what that needs: the versions before the first already evaluated one that reaches it (all of
    them if none does), in order, until one does."""
    sampled = next((i for i, v in enumerate(versions) if v.get("heldout_loss", math.inf) <= goal), len(versions))
    return next((i for i in range(sampled) if loss(versions[i]) <= goal), None if sampled == len(versions) else sampled)


def targets(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The best baseline mode (lowest median final loss) and the two targets derived from it."""
    finals: dict[str, list[float]] = {}
    for row in rows:
        if row["baseline"]:
            finals.setdefault(row["mode"], []).append(row["versions"][-1]["heldout_loss"])
    if not finals:
        raise ValueError("no baseline mode ran: the targets are a baseline's final loss")
    best = min(finals, key=lambda m: statistics.median(finals[m]))
    start = statistics.median(row["versions"][0]["heldout_loss"] for row in rows)
    target = round(statistics.median(finals[best]), 4)
    return {"best_baseline": best, "start_loss": start, "target_loss": target,
            "target90_loss": round(start - 0.9 * (start - target), 4),
            "baseline_final_losses": {m: sorted(v) for m, v in finals.items()}}


def evaluate(rows: list[dict[str, Any]], s: Settings, loss: Loss | None = None) -> dict[str, Any]:
    """Score the runs' versions (their weights' files), time each run to both targets; the targets."""
    loss = loss or scorer(s)
    for row in rows:
        sample(row["versions"], 0 if row["baseline"] else s.max_eval_versions, loss)
    goals = targets(rows)
    for row in rows:
        versions = row["versions"]
        for key, goal in (("time_to_target_s", goals["target_loss"]), ("time_to_target90_s", goals["target90_loss"])):
            first = first_reaching(versions, goal, loss)
            row[key] = round(versions[first]["seconds"], 1) if first is not None else None
            row[key.replace("time_to", "steps_to").removesuffix("_s")] = steps_at(row, row[key])
        evaluated = [v["heldout_loss"] for v in versions if "heldout_loss" in v]
        row["heldout_start"], row["heldout_best"] = evaluated[0], min(evaluated)
        row["heldout_final"] = versions[-1]["heldout_loss"]
        row["versions_kept"], row["versions_evaluated"] = len(versions), len(evaluated)
    return goals


def steps_at(row: dict[str, Any], seconds: float | None) -> float | None:
    """Optimiser steps per worker trained by ``seconds`` after the expert's creation (the row's ``step_clock``;
    None: the target was never reached, or the row has no clock)."""
    if seconds is None or not row.get("step_clock"):
        return None
    return max((steps for t, steps in row["step_clock"] if t <= seconds), default=0.0)


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Median and range of the runs' values; a run that never reached a target counts as None (and the median
    is None when half or more never did)."""
    known = sorted(v for v in values if v is not None)
    missing = len(values) - len(known)
    median = None if missing * 2 >= len(values) or not known else statistics.median(known + [math.inf] * missing)
    return {"median": None if median is None or math.isinf(median) else round(median, 3),
            "min": known[0] if known else None, "max": None if missing or not known else known[-1],
            "runs": len(values), "never": missing}


SUMMARY_KEYS = ("time_to_target_s", "time_to_target90_s", "steps_to_target", "steps_to_target90", "heldout_final", "heldout_best", "root_ingress_bytes",
                "root_egress_bytes", "steps_per_worker", "steps_total")


def summarise(rows: Sequence[dict[str, Any]], goals: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per mode: median and range over its runs, and its speed-up against the fastest baseline."""
    modes: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        modes.setdefault(row["mode"], []).append(row)
    lines = [{"mode": mode, "baseline": runs[0]["baseline"], **{k: spread([r.get(k) for r in runs]) for k in SUMMARY_KEYS}}
             for mode, runs in modes.items()]
    for key in ("time_to_target_s", "time_to_target90_s"):
        base = [line[key]["median"] for line in lines if line["baseline"] and line[key]["median"] is not None]
        fastest = min(base) if base else None
        goals[f"fastest_baseline_{key}"] = fastest
        for line in lines:
            mine = line[key]["median"]
            line[key.replace("time_to", "speedup")] = round(fastest / mine, 2) if fastest and mine else None
    return lines
