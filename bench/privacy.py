#!/usr/bin/env python3
"""How much a coordinator learns about a worker's training data, with and without each protection.

A membership-inference attack by an honest-but-curious coordinator (bench/membership.py), on
smollm2-135m and one DS-1000 domain (numpy_expert by default): the domain's training problems are
split by whole problem families into members (what the target worker trains on, 97 problems) and
non-members (97 problems nobody trains on). Every worker starts from the same expert adapter and
takes ``steps`` AdamW steps (a sync's worth: one update). The attacker scores members and non-members
by their loss under what it holds, alone and calibrated by the public base model's loss, and we
report the AUC and the TPR at 1% FPR with 95% bootstrap intervals, next to each arm's held-out loss
on the domain's held-out problems (the protection's cost). The arms, i.e. what the coordinator holds:

- ``single``: one worker's raw update (base + delta): what it receives today from every worker;
- ``mean_of_K``: the FedBuff step of K updates, the target's and K-1 others' (trained on other data:
  two pandas halves and sklearn): the new expert version;
  With secure aggregation and a cohort of K, the coordinator learns only the sum of the K updates:
  the same information as this mean, scaled, so ``mean_of_K`` is that arm by construction;
- ``dp_fedavg_eps*``: DP-FedAvg's step on those K updates (clip at C = their median norm, Gaussian
  noise sigma x C, sigma calibrated to epsilon at delta for this one step; accounting with q = 1):
  what everyone who sees the expert holds, and what the coordinator holds with secure aggregation and
  distributed noise. Without secure aggregation the coordinator still sees each raw update (``single``);
- ``dp_secagg_eps*``: the same DP-FedAvg step made as the product makes it under --secure-aggregation
  --dp-noise: each of the K workers clips its update to C and adds N(0, (sigma C)^2 / K), then the real
  cohort protocol (privacy.secagg, in this process: fixed-point quantisation, pairwise and self masks)
  unmasks the sum, divided by K. What the coordinator itself holds, with the noise drawn from the OS's
  entropy as the members draw it;
- ``dp_sgd_eps*``: the target worker trains with example-level DP-SGD (worker/dp_sgd.py, Opacus, noise
  calibrated to epsilon over its steps at Poisson rate q = batch / members), and the coordinator holds
  its update.

Learning claims count optimiser steps, not seconds. Trained deltas and per-example losses are cached
(``--cache``), so a rerun with more arms only trains and scores what is new.

    python -m bench.privacy                 # smollm2-135m (make smollm2): ~35 CPU minutes
    python -m bench.privacy --quick         # tiny-qwen2 smoke run
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from bench.common import format_table, run_parallel
from bench.harness import Bench, Run, jsonable
from bench.membership import MembershipSplit, attack, dp_auc_bound, membership_split
from bench.realdata import DS1000_DATA, REAL_MODEL, SMOKE_MODEL, Lab, ds1000_domains, loss_pair, shards
from protocol.cli import option
from privacy.accountant import noise_multiplier_for
from privacy.dp import DPFedAvgSettings, dp_fedavg_step, noise_generator, update_norm
from privacy.secagg.aggregator import SecAggSettings, SecureAggregator
from privacy.secagg.journal import CohortJournal
from privacy.secagg.noise import CohortNoise
from privacy.secagg.session import CohortSession
from privacy.secagg.vector import flatten, unflatten
from protocol.tensors import manifest_of
from worker.data import Example
from worker.dp_sgd import DPSGDSettings, DPSGDTrainer
from worker.evaluation import AnswerLoss
from worker.trainer import LoraSettings, TrainSettings

log = logging.getLogger("bench.privacy")
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)  # Opacus, frozen inputs
ROOT = Path(__file__).resolve().parents[1]


ARM_GROUPS = ("single", "mean", "dp_fedavg", "dp_secagg", "dp_sgd")
"""What ``--arms`` chooses from; each group trains and scores only what it needs (the rest stays cached)."""


@dataclass(frozen=True)
class Settings:
    model: str = option(REAL_MODEL, "base model")
    domain: str = option("numpy_expert", "DS-1000 domain of the target")
    steps: int = option(48, "optimiser steps per worker update")
    """AdamW steps each worker takes before its update is sent (batch x <= max_seq_len tokens)."""
    batch_size: int = 4
    max_seq_len: int = 128
    lr: float = option(3e-3, "every worker's AdamW learning rate")
    """Every worker's AdamW lr: the project's federated workers' lr on smollm2 (bench/quality_compression.py)."""
    cohort: int = option(4, "K: updates per FedBuff step / secure-aggregation cohort")
    """K: updates in one FedBuff step / one secure-aggregation cohort."""
    delta: float = 1e-5
    dp_fedavg_epsilons: tuple[float, ...] = option((1.0, 4.0, 8.0), "epsilons of the DP-FedAvg arms", nargs="+",
                                                   type=float, metavar="EPS")
    dp_sgd_epsilons: tuple[float, ...] = (8.0,)
    dp_sgd_clip: float = 1.0
    """DP-SGD's per-example gradient clipping norm C."""
    bootstrap: int = 1000
    limit: int = 0
    """Members and non-members each cut to this many (0: all); for smoke runs."""
    seed: int = 0
    arms: tuple[str, ...] = option(ARM_GROUPS, "arm groups to train and score now (others already scored in --cache "
                                   "are reported too)", nargs="+", choices=ARM_GROUPS)
    train: tuple[str, ...] = option((), "only train these updates into --cache (target, other1.., dp_sgd_eps8) and "
                                    "exit", nargs="+", metavar="UPDATE")
    jobs: int = option(1, "processes training/scoring at once (each 1 torch thread)")
    cache: Path | None = option(None, "where deltas and losses are kept between runs (default: /tmp/fedmoe-privacy-"
                                "<tag>)", type=Path)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if not 1 <= self.cohort <= 7:
            raise ValueError(f"--cohort must be 1-7 (the target and up to 6 other workers' data), got {self.cohort}")
        if self.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, got {self.jobs}")
        if "dp_secagg" in self.arms and self.cohort < 2:
            raise ValueError(f"--arms dp_secagg needs a cohort of 2 or more (--cohort), got {self.cohort}")

    @property
    def tag(self) -> str:
        """What a cached delta depends on."""
        return f"{self.model}-{self.domain}-s{self.steps}-b{self.batch_size}-l{self.max_seq_len}-lr{self.lr}-n{self.limit}"


QUICK = {"model": SMOKE_MODEL, "steps": 6, "lr": 1e-2, "limit": 24, "bootstrap": 200, "dp_fedavg_epsilons": (8.0,)}
"""--quick: a tiny-qwen2 smoke run (seconds)."""


@dataclass(frozen=True)
class Data:
    split: MembershipSplit
    heldout: tuple[Example, ...]
    others: tuple[tuple[str, tuple[Example, ...]], ...]
    """The other K-1 workers' data: the pandas training problems in two halves, then sklearn's."""

    @property
    def scored(self) -> list[Example]:
        return [*self.split.members, *self.split.nonmembers, *self.heldout]


def load_data(s: Settings) -> Data:
    split = membership_split(DS1000_DATA / "train" / f"{s.domain}.jsonl", s.domain)
    if s.limit:
        split = dataclasses.replace(split, members=split.members[:s.limit], nonmembers=split.nonmembers[:s.limit])
    domains = {d.name: d for d in ds1000_domains()}
    pool = [(f"{d.name}/{i}", tuple(shard)) for d in domains.values() if d.name != s.domain
            for i, shard in enumerate(shards(d.train, 2))]
    others = tuple((name, ex[:s.limit * 2] if s.limit else ex) for name, ex in pool[:s.cohort - 1])
    return Data(split, domains[s.domain].heldout, others)


@functools.lru_cache(maxsize=1)
def _lab(model: str, batch_size: int, max_seq_len: int) -> Lab:
    torch.set_num_threads(1)
    return Lab(model, batch_size=batch_size, max_seq_len=max_seq_len)


def train_update(s: Settings, name: str, examples: Sequence[Example], dp_sgd_sigma: float | None,
                 out: Path) -> dict[str, Any]:
    """One worker's ``s.steps`` steps from the common initial adapter; its delta saved to ``out``."""
    lab = _lab(s.model, s.batch_size, s.max_seq_len)
    started = time.process_time()
    lora = LoraSettings(rank=8, alpha=16.0)
    train = TrainSettings(lr=s.lr, batch_size=s.batch_size, max_seq_len=s.max_seq_len, seed=s.seed)
    base = dataclasses.replace(lab.base, model=copy.deepcopy(lab.base.model))
    if dp_sgd_sigma is None:
        trainer = lab.trainer(examples, s.seed, lr=s.lr)
    else:
        trainer = DPSGDTrainer(base, lora, train, list(examples), DPSGDSettings(dp_sgd_sigma, s.dp_sgd_clip, s.delta))
    initial = trainer.adapter_state()
    stats = trainer.train_steps(s.steps)
    after = trainer.adapter_state()
    save_file({k: (after[k] - initial[k]).contiguous() for k in initial}, str(out))
    save_file(initial, str(out.with_suffix(".init.safetensors")))
    meta = {"name": name, "examples": len(examples), "steps": s.steps, "train_loss": stats.loss,
            "lora": trainer.lora_config, "cpu_seconds": time.process_time() - started}
    if isinstance(trainer, DPSGDTrainer):
        meta["privacy"] = trainer.privacy_spent()
    out.with_suffix(".json").write_text(json.dumps(meta))
    return meta


def score_adapter(s: Settings, adapter_file: Path | None, lora: dict[str, Any] | None, out: Path) -> list[list[float]]:
    """Per-example [nll, tokens, nll_without_end, tokens_without_end] of every scored example, saved to ``out``."""
    lab = _lab(s.model, s.batch_size, s.max_seq_len)
    data = load_data(s)
    adapter = load_file(str(adapter_file)) if adapter_file is not None else None
    losses = lab.losses(data.scored, adapter, lora)
    rows = [[x.nll, x.tokens, x.nll_without_end, x.tokens_without_end] for x in losses]
    out.write_text(json.dumps(rows))
    return rows


def _cached(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0




def updates_needed(s: Settings, groups: Sequence[str]) -> list[str]:
    names = ["target"]
    if {"mean", "dp_fedavg", "dp_secagg"} & set(groups):
        names += [f"other{i}" for i in range(1, s.cohort)]
    if "dp_sgd" in groups:
        names += [f"dp_sgd_eps{eps:g}" for eps in s.dp_sgd_epsilons]
    return names


def train_all(s: Settings, data: Data, cache: Path, jobs: int, groups: Sequence[str],
              only: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """The updates the chosen arm groups need (or the ``only`` ones named), trained where not cached."""
    examples: dict[str, tuple[Sequence[Example], float | None]] = {"target": (data.split.members, None)}
    examples |= {f"other{i}": (ex, None) for i, (_, ex) in enumerate(data.others, start=1)}
    q = min(1.0, s.batch_size / len(data.split.members))
    for eps in s.dp_sgd_epsilons:
        examples[f"dp_sgd_eps{eps:g}"] = (data.split.members, noise_multiplier_for(eps, s.delta, s.steps, q))
    wanted = list(only) or updates_needed(s, groups)
    unknown = sorted(set(wanted) - set(examples))
    if unknown:
        raise SystemExit(f"--train: unknown update(s) {unknown}; known: {', '.join(examples)}")
    tasks = [(train_update, (s, name, list(examples[name][0]), examples[name][1], cache / f"{name}.safetensors"))
             for name in wanted if not _cached(cache / f"{name}.json")]
    log.info("training %d of %d updates (%d steps each)", len(tasks), len(wanted), s.steps)
    run_parallel(tasks, jobs, lambda done, meta: log.info("trained %s (%d/%d)", meta["name"], done, len(tasks)))
    return {name: json.loads((cache / f"{name}.json").read_text()) for name in wanted}


def load_delta(cache: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(cache / f"{name}.safetensors"))


def build_arms(s: Settings, cache: Path, trained: dict[str, dict[str, Any]], groups: Sequence[str]) -> list[str]:
    """Each chosen arm's adapter (initial + what the coordinator holds) and description, saved in the cache."""
    initial = load_file(str(cache / "target.init.safetensors"))
    built: list[str] = []

    def add(name: str, change: dict[str, torch.Tensor], **info: Any) -> None:
        save_file({k: (initial[k] + change[k]).contiguous() for k in initial}, str(cache / f"arm-{name}.safetensors"))
        info = {"update_norm": update_norm(change), "lora": trained["target"]["lora"], **info}
        (cache / f"arm-{name}.json").write_text(json.dumps(info))
        built.append(name)

    if "single" in groups:
        add("single", load_delta(cache, "target"))
    if {"mean", "dp_fedavg", "dp_secagg"} & set(groups):
        updates = [load_delta(cache, "target")] + [load_delta(cache, f"other{i}") for i in range(1, s.cohort)]
        if "mean" in groups:
            add(f"mean_of_{s.cohort}", {k: torch.stack([u[k] for u in updates]).sum(0) / s.cohort for k in initial})
        if "dp_fedavg" in groups:
            clip = statistics.median(update_norm(u) for u in updates)
            for eps in s.dp_fedavg_epsilons:
                sigma = noise_multiplier_for(eps, s.delta, steps=1)
                settings = DPFedAvgSettings(clip_norm=clip, noise_multiplier=sigma, delta=s.delta)
                step = {k: torch.zeros_like(v) for k, v in initial.items()}
                # a fixed noise seed per epsilon, so that a rerun scores the same draw (the product draws from
                # the OS's entropy: privacy.dp.noise_generator)
                report = dp_fedavg_step(step, updates, settings, s.cohort, 1.0,
                                        noise_generator(s.seed + int(eps * 1000)))
                add(f"dp_fedavg_eps{eps:g}_of_{s.cohort}", step, epsilon=eps, delta=s.delta, noise_multiplier=sigma,
                    clip_norm=clip, clipped=report.clipped, noise_std_per_coordinate=settings.noise_std / s.cohort,
                    contributions_norms=list(report.norms))
        if "dp_secagg" in groups:
            clip = statistics.median(update_norm(u) for u in updates)
            for eps in s.dp_fedavg_epsilons:
                name = f"dp_secagg_eps{eps:g}_of_{s.cohort}"
                if _cached(cache / f"arm-{name}.json") and _cached(cache / f"loss-{name}.json"):
                    built.append(name)  # its noise is fresh from the OS: keep the draw that was scored
                    continue
                sigma = noise_multiplier_for(eps, s.delta, steps=1)
                add(name, secure_dp_step(updates, CohortNoise(sigma, clip)), epsilon=eps, delta=s.delta,
                    noise_multiplier=sigma, clip_norm=clip, noise_std_per_coordinate=sigma * clip / s.cohort)
    if "dp_sgd" in groups:
        for eps in s.dp_sgd_epsilons:
            name = f"dp_sgd_eps{eps:g}"
            add(name, load_delta(cache, name), target_epsilon=eps, **trained[name]["privacy"])
    return built


def secure_dp_step(updates: Sequence[dict[str, torch.Tensor]], noise: CohortNoise) -> dict[str, torch.Tensor]:
    """The step a --secure-aggregation --dp-noise coordinator applies for one cohort of these updates: the real
    protocol in this process (members clip, add their noise share, quantise and mask; the aggregator unmasks)."""
    manifest = manifest_of(updates[0])
    members = [f"w{i}" for i in range(len(updates))]
    with tempfile.TemporaryDirectory() as journal:
        agg = SecureAggregator(CohortJournal(Path(journal)), SecAggSettings(cohort_size=len(updates)),
                               lambda expert: sum(v.numel() for v in updates[0].values()), dp=noise)
        sessions = [CohortSession(agg, "target_expert", m) for m in members]
        for _ in range(4):  # join, keys, shares, open the shares
            for session in sessions:
                session.advance()
        for i, (session, update) in enumerate(zip(sessions, updates)):
            session.submit(flatten(update, manifest), 1, {"base_version": 0}, rounding_seed=i)
        for _ in range(2):  # the unmasking answers
            for session in sessions:
                session.advance()
        [ready] = agg.ready()
    return unflatten(ready.mean, manifest)


def score_all(s: Settings, cache: Path, arms: Sequence[str], jobs: int) -> None:
    """Per-example losses of the base model and of each arm, where not cached."""
    wanted = {"base": None, **{name: cache / f"arm-{name}.safetensors" for name in arms}}
    lora = json.loads((cache / f"arm-{arms[0]}.json").read_text())["lora"] if arms else None
    tasks = [(score_adapter, (s, path, lora if path else None, cache / f"loss-{name}.json"))
             for name, path in wanted.items() if not _cached(cache / f"loss-{name}.json")]
    log.info("scoring %d of %d models", len(tasks), len(wanted))
    run_parallel(tasks, jobs, lambda done, _: log.info("scored %d/%d", done, len(tasks)))


def scored_arms(cache: Path) -> dict[str, dict[str, Any]]:
    """Every arm scored so far in this cache (by this or an earlier run), with its description."""
    order = {group: i for i, group in enumerate(ARM_GROUPS)}
    names = [p.name[len("loss-"):-len(".json")] for p in cache.glob("loss-*.json")]
    names = [n for n in names if n != "base" and (cache / f"arm-{n}.json").is_file()]
    names.sort(key=lambda n: (next((i for g, i in order.items() if n.startswith(g)), 9), n))
    return {n: json.loads((cache / f"arm-{n}.json").read_text()) for n in names}


def per_example_mean(rows: Sequence[Sequence[float]]) -> list[float]:
    return [nll / tokens if tokens else 0.0 for nll, tokens, _, _ in rows]


def summarize(s: Settings, data: Data, cache: Path) -> dict:
    arms = scored_arms(cache)
    losses = {name: json.loads((cache / f"loss-{name}.json").read_text()) for name in ["base", *arms]}
    n_m, n_n = len(data.split.members), len(data.split.nonmembers)
    is_member = [True] * n_m + [False] * n_n
    base = per_example_mean(losses["base"])[:n_m + n_n]
    out: dict[str, Any] = {}
    for name in ["base", *arms]:
        rows = losses[name]
        heldout = loss_pair([AnswerLoss(*r) for r in rows[n_m + n_n:]])
        record: dict[str, Any] = {"heldout_loss": heldout["loss"], "heldout_loss_without_end": heldout["loss_without_end"],
                                  "members_loss": loss_pair([AnswerLoss(*r) for r in rows[:n_m]])["loss"],
                                  "nonmembers_loss": loss_pair([AnswerLoss(*r) for r in rows[n_m:n_m + n_n]])["loss"]}
        if name != "base":
            record["attack"] = attack(per_example_mean(rows)[:n_m + n_n], base, is_member, s.bootstrap)
            record.update({k: v for k, v in arms[name].items() if k != "lora"})
            if "epsilon" in arms[name]:  # the most any membership test can reach against this guarantee
                record["dp_auc_bound"] = dp_auc_bound(arms[name]["epsilon"], arms[name]["delta"])
        out[name] = record
    return out


def render(results: dict[str, Any]) -> str:
    rows = []
    for name, r in results.items():
        a = r.get("attack", {})
        rows.append([name, r["heldout_loss"], r["members_loss"], r["nonmembers_loss"],
                     *(f"{a[k]['auc']:.3f} [{a[k]['auc_ci'][0]:.2f}, {a[k]['auc_ci'][1]:.2f}]" if a else "-"
                       for k in ("loss", "calibrated")),
                     f"{a['calibrated']['tpr_at_1pct_fpr']:.3f}" if a else "-"])
    return format_table(["what the attacker holds", "held-out loss", "members", "non-members", "AUC loss [95% CI]",
                         "AUC calibrated [95% CI]", "TPR@1%FPR cal."], rows, align="lrrrllr")


def run(s: Settings, ctx: Run) -> int:
    cache = s.cache or Path("/tmp") / f"fedmoe-privacy-{s.tag}"
    cache.mkdir(parents=True, exist_ok=True)
    data = load_data(s)
    trained = train_all(s, data, cache, s.jobs, s.arms, s.train)
    if s.train:  # only train (a way to spread one run's trainings over processes started one by one)
        return 0
    score_all(s, cache, build_arms(s, cache, trained, s.arms), s.jobs)
    results = summarize(s, data, cache)
    print(render(results))
    updates = {p.stem: json.loads(p.read_text()) for p in sorted(cache.glob("*.json"))
               if not p.name.startswith(("arm-", "loss-"))}
    ctx.write({"settings": jsonable(dataclasses.asdict(s)), "members": len(data.split.members),
               "nonmembers": len(data.split.nonmembers), "heldout": len(data.heldout),
               "others": [name for name, _ in data.others], "updates": updates, "arms": results,
               "wall_seconds_this_run": ctx.seconds()})
    print(f"wrote {ctx.out}")
    return 0


BENCH = Bench("privacy", tags=("privacy",), settings=Settings, run=run, quick=QUICK, cores=1)
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
