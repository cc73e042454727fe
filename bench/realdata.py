"""What the real-model quality suites share: DS-1000 from data/ds1000, one loaded base model, losses.

Spider's text-to-SQL domain (data/spider, ``spider_domain()``) is available too, but no suite loads it by
default, so the results committed before it came stay comparable.

Data: the three DS-1000 domains the repository ships (``data/ds1000/{train,heldout}/<domain>.jsonl``,
CC BY-SA 4.0). ``heldout/`` is never trained on nor tuned on. Settings (merge lam, the router
threshold) are tuned on a *validation* split carved from ``train/`` by the same family rule that
made the held-out split (``data/ds1000/split.py``: whole families of perturbed variants of one
problem go to one side), so a validation problem has no near-copy left in training.

Model: ``smollm2-135m`` (``make smollm2``) for the real suites, ``tiny-qwen2`` for the smoke runs.
The base model is loaded once per process; every trainer wraps its own deep copy.

Losses: the mean answer-token loss, with and without the end-of-answer token (a chat model new to
the data's format pays 7-11 nats on it, so a short fine-tune's gain is partly learning to stop).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.heldout import with_adapter
from protocol.cli import option
from worker.data import Example
from worker.evaluation import AnswerLoss, answer_losses, total
from models.loading import load_base_model
from models.presets import RECOMMENDED_LR
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

ROOT = Path(__file__).resolve().parents[1]
DS1000_DATA = ROOT / "data" / "ds1000"
SPIDER_DATA = ROOT / "data" / "spider"
SPIDER_DOMAIN = "sql_expert"
DOMAINS = ("numpy_expert", "pandas_expert", "sklearn_expert")
REAL_MODEL = "smollm2-135m"
SMOKE_MODEL = "tiny-qwen2"


@dataclass(frozen=True)
class RealDomain:
    """One DS-1000 library: what its workers train on, what settings are tuned on, what is judged."""

    name: str
    train: tuple[Example, ...]
    validation: tuple[Example, ...]
    heldout: tuple[Example, ...]


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise SystemExit(f"{path} is missing; the data ships in the repository (see {path.parent.parent / 'README.md'})")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _examples(records: Sequence[Mapping[str, Any]]) -> tuple[Example, ...]:
    return tuple(Example(r["prompt"], r["reference_code"]) for r in records)


@functools.lru_cache(maxsize=2)
def ds1000_domains(directory: Path = DS1000_DATA) -> tuple[RealDomain, ...]:
    """The shipped domains, each with a validation split carved from train/ by whole families.

    The validation problem ids are committed (``data/ds1000/validation.json``, written and checked by
    ``python data/ds1000/split.py --validation [--check]``): the family rule compares prompts pairwise
    with difflib, ~15 s of CPU that every benchmark process paid before.
    """
    path = directory / "validation.json"
    if not path.is_file():
        raise SystemExit(f"{path} is missing; regenerate it with: python data/ds1000/split.py --validation")
    held_ids = json.loads(path.read_text(encoding="utf-8"))
    domains = []
    for name in DOMAINS:
        records = _records(directory / "train" / f"{name}.jsonl")
        validation_ids = set(held_ids.get(name, ()))
        if not validation_ids <= {r["problem_id"] for r in records}:
            raise SystemExit(f"{path} names {name} problems that are not in train/; "
                             "regenerate it with: python data/ds1000/split.py --validation")
        train = [r for r in records if r["problem_id"] not in validation_ids]
        validation = [r for r in records if r["problem_id"] in validation_ids]
        domains.append(RealDomain(name, _examples(train), _examples(validation),
                                  _examples(_records(directory / "heldout" / f"{name}.jsonl"))))
    return tuple(domains)


@functools.lru_cache(maxsize=2)
def spider_domain(directory: Path = SPIDER_DATA) -> RealDomain:
    """Spider's text-to-SQL questions as one more domain, not loaded by any benchmark by default (their committed
    results stay comparable): ``(*ds1000_domains(), spider_domain())`` adds it.

    Every split is by whole databases: ``heldout/`` asks about databases no training question uses, and the
    validation questions are those of train/'s databases named in ``data/spider/validation.json``.
    """
    path = directory / "validation.json"
    if not path.is_file():
        raise SystemExit(f"{path} is missing; regenerate it with data/spider/split.py (see data/spider/README.md)")
    validation_dbs = set(json.loads(path.read_text(encoding="utf-8")).get(SPIDER_DOMAIN, ()))
    records = _records(directory / "train" / f"{SPIDER_DOMAIN}.jsonl")
    if not validation_dbs <= {r["db_id"] for r in records}:
        raise SystemExit(f"{path} names databases that are not in train/; regenerate it with data/spider/split.py")
    return RealDomain(SPIDER_DOMAIN, _examples([r for r in records if r["db_id"] not in validation_dbs]),
                      _examples([r for r in records if r["db_id"] in validation_dbs]),
                      _examples(_records(directory / "heldout" / f"{SPIDER_DOMAIN}.jsonl")))


def shards(examples: Sequence[Example], n: int) -> list[list[Example]]:
    """n disjoint shards (example i goes to shard i mod n): the workers' own data."""
    return [list(examples[i::n]) for i in range(n)]


@dataclass
class Compute:
    """Optimiser steps and forward passes taken, with the CPU time they cost (for quiet-machine estimates).

    On a shared machine wall time says little; this process's CPU seconds per step, with one torch
    thread, is close to what the step takes on a quiet core.
    """

    train_steps: int = 0
    train_cpu: float = 0.0
    eval_examples: int = 0
    eval_cpu: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        per_step = self.train_cpu / self.train_steps if self.train_steps else None
        per_eval = self.eval_cpu / self.eval_examples if self.eval_examples else None
        return {**dataclasses.asdict(self), "cpu_seconds_per_step": per_step, "cpu_seconds_per_eval_example": per_eval}


class Lab:
    """One base model loaded once; fresh trainers on copies of it; losses of any adapter."""

    def __init__(self, model_id: str, batch_size: int = 4, max_seq_len: int = 128) -> None:
        self.model_id = model_id
        self.base = load_base_model(model_id)
        self.lr = RECOMMENDED_LR.get(model_id, 2e-4)
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.compute = Compute()

    def trainer(self, examples: Sequence[Example], seed: int, rank: int = 8, lr: float | None = None) -> LoraTrainer:
        """A LoRA trainer (r=rank, alpha=2r, every projection) on its own copy of the base model.

        ``lr``: the AdamW learning rate (None: the preset's recommended one, ``self.lr``).
        """
        base = dataclasses.replace(self.base, model=copy.deepcopy(self.base.model))
        return LoraTrainer(base, LoraSettings(rank=rank, alpha=2.0 * rank),
                           TrainSettings(lr=lr or self.lr, batch_size=self.batch_size, max_seq_len=self.max_seq_len,
                                         seed=seed), list(examples))

    def train(self, trainer: LoraTrainer, steps: int) -> float:
        """``steps`` optimiser steps; their mean train loss. CPU time is booked in ``compute``."""
        started = time.process_time()
        stats = trainer.train_steps(steps)
        self.compute.train_cpu += time.process_time() - started
        self.compute.train_steps += steps
        return stats.loss

    def losses(self, examples: Sequence[Example], adapter: Mapping[str, torch.Tensor] | None = None,
               lora: Mapping[str, Any] | None = None) -> list[AnswerLoss]:
        """Per-example answer losses of the base model with ``adapter`` (None: the base model itself)."""
        started = time.process_time()
        out = answer_losses(with_adapter(self.base, adapter, lora), self.base.tokenizer, list(examples),
                            max_seq_len=self.max_seq_len)
        self.compute.eval_cpu += time.process_time() - started
        self.compute.eval_examples += len(examples)
        return out


def loss_pair(losses: Sequence[AnswerLoss]) -> dict[str, float]:
    """{"loss": mean per answer token, "loss_without_end": the same without the end-of-answer token}."""
    summed = total(losses)
    return {"loss": summed.mean, "loss_without_end": summed.mean_without_end}


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample standard deviation, min and max of per-seed values (NaNs kept out, counted)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0, "values": list(values)}
    return {"mean": statistics.fmean(finite), "std": statistics.stdev(finite) if len(finite) > 1 else 0.0,
            "min": min(finite), "max": max(finite), "n": len(finite), "values": list(values)}


def pm(s: Mapping[str, Any], spec: str = ".4f") -> str:
    """'mean +/- std (min..max, n)' of a ``spread`` record."""
    if not s["n"]:
        return "-"
    return f"{format(s['mean'], spec)} +/- {format(s['std'], spec)} (n={s['n']})"


def pct(value: float, reference: float) -> float:
    """``value`` relative to ``reference``, in percent."""
    return 100.0 * (value - reference) / reference


def quiet_estimate(compute: Compute, wall_seconds: float) -> dict[str, Any]:
    """What this process cost: CPU seconds (~ wall on a quiet core with one torch thread) and wall seconds,
    with the machine's load averages at the end (1, 5, 15 min: how shared the cores were)."""
    cpu = time.process_time()
    return {"process_cpu_seconds": round(cpu, 1), "wall_seconds": round(wall_seconds, 1),
            "busy_factor": round(wall_seconds / cpu, 2) if cpu else None,
            "load_average_at_end": [round(x, 1) for x in os.getloadavg()], **compute.as_dict()}


def heldout_size(domain: str, directory: Path = DS1000_DATA) -> int:
    """Problems in a domain's held-out split, counted without building the validation split (no difflib)."""
    path = directory / "heldout" / f"{domain}.jsonl"
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip()) if path.is_file() else 0


@dataclass(frozen=True)
class Estimate:
    """--estimate and --priced-from, the same for every quality suite: their settings inherit them."""

    estimate: bool = option(False, "print the planned optimiser steps and scored problems (and CPU seconds at the "
                            "per-step and per-problem costs of the last results JSON), run nothing")
    priced_from: Path | None = option(None, "with --estimate: the results JSON whose measured CPU seconds per step "
                                      "and per scored problem price the plan (default: this suite's --out)",
                                      type=Path, metavar="JSON")


def planned_cost(train_steps: int, eval_examples: int, measured: Path) -> dict[str, Any]:
    """A plan's optimiser steps and scored problems, priced at the CPU costs ``measured`` (a results JSON's
    ``cost``) recorded, when there is one: the time budget of ``make bench-quality`` is checked with this."""
    out: dict[str, Any] = {"train_steps": train_steps, "eval_examples": eval_examples}
    try:
        cost = json.loads(measured.read_text())["cost"]
        per_step, per_eval = float(cost["cpu_seconds_per_step"]), float(cost["cpu_seconds_per_eval_example"])
    except (OSError, ValueError, KeyError, TypeError):
        return out
    return {**out, "cpu_seconds_per_step": round(per_step, 2), "cpu_seconds_per_eval_example": round(per_eval, 3),
            "priced_from": str(measured.relative_to(ROOT)) if measured.is_relative_to(ROOT) else str(measured), "cpu_seconds": round(train_steps * per_step + eval_examples * per_eval)}


def render_plan(name: str, plan: Mapping[str, Any]) -> str:
    line = f"{name}: {plan['train_steps']} optimiser steps, {plan['eval_examples']} scored problems"
    if "cpu_seconds" in plan:
        line += (f" = ~{plan['cpu_seconds']} CPU s at {plan['cpu_seconds_per_step']} s/step and "
                 f"{plan['cpu_seconds_per_eval_example']} s/problem ({plan['priced_from']})")
    return line
