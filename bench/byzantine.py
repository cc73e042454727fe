#!/usr/bin/env python3
"""Poisoning benchmark: one worker in five sends poisoned updates; which aggregation survives it?

Each job is a fresh coordinator on loopback running fedbuff (one aggregated step per round of
updates) and tiny-qwen2 workers on one domain, each training on its own shard. Every round
every worker starts from the expert's current weights, takes ``steps`` AdamW steps and pushes
its delta; worker 5 of 5 is the attacker. It trains like the others, then sends

- ``sign_flip``: its delta times -4 (pulls the expert back harder than the honest ones push), or
- ``scale``: its delta times 10 (overshoots).

The reference is the *honest-only* run: the four honest workers alone, plain averaging. Every
other run adds the attacker and uses one aggregation: plain averaging (``none``, for contrast),
norm clipping, coordinate-wise median or trimmed mean (``--robust``), or plain averaging behind
the coordinator's norm check (``--norm-check reject``). The score is the expert's held-out loss
relative to the honest-only run; the target is within 2%.

    python -m bench.byzantine            # 11 jobs, ~2 min of CPU (1 torch thread)
    python -m bench.byzantine --quick    # 3 short jobs (smoke test)

Table on stdout, progress on stderr, results in bench/results/byzantine.json.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from bench.common import Domain, format_table, load_suites, pulled_tensors, running_coordinator
from bench.harness import Bench, Run
from protocol.cli import option
from protocol.client import CoordinatorClient
from protocol.errors import InvalidUpdate
from protocol.tensors import StateDict, dumps
from bench.heldout import adapter_loss
from models.loading import load_base_model
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench.byzantine")
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

BASE_MODEL = "tiny-qwen2"
DOMAIN = "python_expert"
TARGET_PCT = 2.0
ATTACKS: dict[str, Callable[[StateDict], StateDict]] = {
    "sign_flip": lambda delta: {k: -4.0 * t for k, t in delta.items()},
    "scale": lambda delta: {k: 10.0 * t for k, t in delta.items()},
}
"""What the attacker sends instead of its honest delta."""


@dataclass(frozen=True)
class Job:
    attack: str | None
    """Key of ATTACKS, or None for the honest-only reference (attacker left out)."""
    robust: str = "none"
    """Coordinator --robust."""
    norm_check: str = "off"
    """Coordinator --norm-check."""

    @property
    def label(self) -> str:
        rule = self.robust if self.norm_check == "off" else f"{self.robust}+norm-check {self.norm_check}"
        return f"{self.attack or 'honest only'} / {rule}"


RUNS = (Job(None),) + tuple(Job(attack, robust) for attack in ATTACKS
                            for robust in ("none", "clip", "median", "trimmed_mean")) + tuple(
    Job(attack, "none", "reject") for attack in ATTACKS)
QUICK_RUNS = (Job(None), Job("scale"), Job("scale", "median"))


@dataclass(frozen=True)
class Settings:
    workers: int = 5
    """Workers in an attacked run, one of them the attacker (honest-only runs without it)."""
    rounds: int = option(24, "rounds; every worker pushes once per round")
    steps: int = option(2, "AdamW steps per worker per round")
    batch_size: int = 4
    max_seq_len: int = 128
    lr: float = option(1e-2, "AdamW learning rate; near the best for the random-init tiny-qwen2, so a larger step is "
                       "not a free gain")
    lora_rank: int = 8
    norm_factor: float = 3.0
    """--norm-factor of the norm-check runs."""
    trim_fraction: float = 0.2
    """--trim-fraction: trims one value of five at each end."""
    seed: int = 0
    jobs: tuple[Job, ...] = RUNS
    """The attack and defence runs, one job each."""

    def __post_init__(self) -> None:
        for name in ("workers", "rounds", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.workers < 3:
            raise ValueError(f"--workers must be at least 3 (one attacker, robust rules need 3), got {self.workers}")


QUICK = {"rounds": 3, "steps": 1, "max_seq_len": 64, "jobs": QUICK_RUNS}


@dataclass
class Member:
    """One worker of the job: its trainer and whether it attacks."""

    worker_id: str
    trainer: LoraTrainer
    attack: Callable[[StateDict], StateDict] | None = None


def run_job(domain: Domain, run: Job, s: Settings) -> dict[str, Any]:
    """One federated job; returns its record (held-out loss, updates pushed and rejected)."""
    started = time.perf_counter()
    honest = s.workers - 1
    team = [make_member(domain, i, s, None) for i in range(honest)]
    if run.attack is not None:
        team.append(make_member(domain, honest, s, ATTACKS[run.attack]))
    pushed = rejected = 0
    settings = dict(aggregation="fedbuff", buffer_size=len(team), robust=run.robust, norm_check=run.norm_check,
                    norm_factor=s.norm_factor, trim_fraction=s.trim_fraction)
    with running_coordinator(**settings) as url:
        client = CoordinatorClient(url)
        spec = {"lora": team[0].trainer.lora_config,
                "base_model": {"id": team[0].trainer.base.model_id, "fingerprint": team[0].trainer.base.fingerprint}}
        client.experts.create(domain.name, team[0].trainer.adapter_state(), spec)
        for _ in range(s.rounds):
            pulled = client.experts.pull(domain.name)
            for member in team:
                try:
                    push_round(client, domain.name, member, pulled_tensors(pulled), pulled.version, s.steps)
                except InvalidUpdate:
                    rejected += 1
                pushed += 1
        final = client.experts.pull(domain.name)
        lora = client.experts.get(domain.name)["lora"]
        client.close()
    loss = adapter_loss(load_base_model(BASE_MODEL), domain.heldout, pulled_tensors(final), lora,  # trainers wrap theirs
                        max_seq_len=s.max_seq_len)
    return {"attack": run.attack, "robust": run.robust, "norm_check": run.norm_check, "label": run.label,
            "workers": len(team), "eval_loss": loss, "version": final.version, "pushed": pushed,
            "rejected": rejected, "seconds": round(time.perf_counter() - started, 2)}


def make_member(domain: Domain, index: int, s: Settings, attack: Callable[[StateDict], StateDict] | None) -> Member:
    shard = list(domain.train[index::s.workers])  # worker i's own data; the attacker's shard is unused without it
    trainer = LoraTrainer(load_base_model(BASE_MODEL), LoraSettings(rank=s.lora_rank, alpha=2.0 * s.lora_rank),
                          TrainSettings(lr=s.lr, batch_size=s.batch_size, max_seq_len=s.max_seq_len,
                                        seed=s.seed + index), shard)
    return Member(f"bench-{index}", trainer, attack)


def push_round(client: CoordinatorClient, name: str, member: Member, start: StateDict, version: int,
               steps: int) -> None:
    """Train from ``start`` and push the delta (poisoned if the member attacks)."""
    member.trainer.load_adapter_state(start)
    stats = member.trainer.train_steps(steps)
    after = member.trainer.adapter_state()
    delta = {k: after[k] - start[k] for k in start}
    if member.attack is not None:
        delta = member.attack(delta)
    meta = {"update_id": f"{member.worker_id}-{uuid.uuid4().hex[:12]}", "base_version": version,
            "num_samples": stats.samples, "train_loss": stats.loss, "worker_id": member.worker_id}
    client.updates.push(name, dumps(delta), meta)


def summarize(records: list[dict[str, Any]], untrained: float, s: Settings, seconds: float) -> dict[str, Any]:
    reference = next(r["eval_loss"] for r in records if r["attack"] is None)
    for r in records:
        r["loss_vs_honest_pct"] = round(100.0 * (r["eval_loss"] - reference) / reference, 3)
        r["within_target"] = r["loss_vs_honest_pct"] <= TARGET_PCT
    return {"benchmark": "byzantine", "base_model": BASE_MODEL, "domain": DOMAIN,
            "settings": dataclasses.asdict(s), "target_pct": TARGET_PCT, "untrained_eval_loss": untrained,
            "honest_eval_loss": reference, "targets": targets(records), "records": records,
            "seconds": round(seconds, 1)}


def targets(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per defence: its loss vs honest-only under each attack, and whether all are within the target."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        if r["attack"] is not None:
            key = r["robust"] if r["norm_check"] == "off" else f"{r['robust']}+norm-check {r['norm_check']}"
            out.setdefault(key, {})[r["attack"]] = r["loss_vs_honest_pct"]
    return {key: pcts | {"met": all(p <= TARGET_PCT for p in pcts.values())} for key, pcts in out.items()}


def render(report: dict[str, Any]) -> str:
    rows = [(r["attack"] or "-", r["robust"], r["norm_check"], r["eval_loss"], r["loss_vs_honest_pct"],
             "yes" if r["within_target"] else "NO", r["rejected"], r["version"], r["seconds"])
            for r in report["records"]]
    table = format_table(["attack", "robust", "norm check", "held-out loss", "vs honest %", "within 2%",
                          "rejected", "versions", "seconds"], rows)
    return (f"{table}\n\nuntrained loss {report['untrained_eval_loss']:.4f}; honest-only "
            f"{report['honest_eval_loss']:.4f}; {report['settings']['workers']} workers, 1 attacker")


def run(s: Settings, ctx: Run) -> int:
    domain = next(d for d in load_suites(["sample"])[0].domains if d.name == DOMAIN)
    records = []
    for i, job in enumerate(s.jobs, start=1):
        records.append(run_job(domain, job, s))
        log.info("[%d/%d] %s: loss %.4f, %d rejected, %.1f s", i, len(s.jobs), job.label, records[-1]["eval_loss"],
                 records[-1]["rejected"], records[-1]["seconds"])
    untrained = adapter_loss(load_base_model(BASE_MODEL), domain.heldout, max_seq_len=s.max_seq_len)
    report = summarize(records, untrained, s, ctx.seconds())
    ctx.write(report)
    print(render(report))
    log.info("wrote %s in %.0f s", ctx.out, report["seconds"])
    return 0


BENCH = Bench("byzantine", tags=("robustness",), settings=Settings, run=run, quick=QUICK)
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
