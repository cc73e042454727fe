#!/usr/bin/env python3
"""Gateway benchmark: how much of each expert's gain a merge or the router keeps.

Three experts are trained on tiny-qwen2, one per domain (DS-1000 numpy/pandas/sklearn as shipped
in data/ds1000/, or the project's sample data with --suite sample), each by its own LoraTrainer;
no coordinator is involved. The real-model version of this benchmark is bench/quality_gateway.py. Every method is then scored by its held-out
answer-token loss per domain, and by the retained gain

    R(d) = (L_base(d) - L_method(d)) / (L_base(d) - L_expert_d(d)),

1 for domain d's own expert, 0 for the base model. Methods: the base model, each expert, the
naive factor average (A and B averaged separately, the known-wrong method), the exact equal-
weight average (gateway.merges weighted_average), each merge of gateway.merges.MERGES twice
(an a-priori setting, and lam picked from a grid by mean R on a validation split), the router
(each held-out prompt routed by gateway.router on profiles of each expert's training prompts,
to that expert or, when not confident, to the exact-average gateway) and the oracle router
(each domain's own expert).

Splits: DS-1000 uses its shipped heldout/ and a validation split carved from train/ by whole
problem families (bench.realdata). The sample data splits by worker.data.split_examples (a stable
hash of the prompt): held-out is hash < 0.1 as everywhere in the project; validation is hash in
[0.1, 0.2), taken from the rest with split_examples(rest, 0.2); the experts train on hash >= 0.2.
The router profiles only the training prompts.

    python -m bench.gateway            # 60 s of training per expert, ~3.5 min on 2 cores
    python -m bench.gateway --quick    # ~5 s per expert and no lam tuning, ~30 s

Table on stdout, progress on stderr, results in bench/results/gateway.json.
"""
from __future__ import annotations

import logging
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import sample_path
from bench.harness import Bench, Run
from protocol.cli import option
from bench.realdata import ds1000_domains
from gateway.lora import split_modules
from gateway.merges import MERGES, merge
from protocol.profiles import text_profile
from gateway.router import DEFAULT_THRESHOLD, route
from worker.data import IGNORE_INDEX, Example, encode_example, load_examples, split_examples
from bench.heldout import adapter_loss
from models.loading import BaseModel, load_base_model
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench.gateway")

BASE_MODEL = "tiny-qwen2"
SAMPLE_DOMAINS = ("python_expert", "sql_expert", "docs_expert")
GATEWAY = "exact_average"
"""The method a router falls back to: the coordinator's default gateway."""

# One a-priori setting per merge, all with weight 1 per expert (the average normalises them).
MERGE_PLAN: dict[str, tuple[str, dict[str, Any]]] = {
    "exact_average": ("weighted_average", {}),
    "task_arithmetic": ("task_arithmetic", {"lam": 1.0}),  # the plain sum of the three updates
    "ties": ("ties", {"density": 0.2, "lam": 1.0}),  # the paper's k = 20%
    "dare": ("dare", {"p": 0.5, "lam": 1.0, "seed": 0}),  # sum of dropped-and-rescaled updates
    "dare_ties": ("dare_ties", {"p": 0.5, "lam": 1.0, "seed": 0}),
}
assert {strategy for strategy, _ in MERGE_PLAN.values()} == set(MERGES), "a merge is not benchmarked"
STEP_CHUNK = 10
"""Steps between checks of the training time budget."""
LAM_GRID = (0.15, 0.25, 1 / 3, 0.5, 0.75, 1.0)
"""lam values tried per merge on the validation split (1/3 of the sum is the average)."""


@dataclass(frozen=True)
class Settings:
    """What one run does."""

    seconds_per_expert: float = option(60.0, "training budget of the first expert; the others take as many steps as "
                                       "it managed")
    steps: int | None = option(None, "fixed steps per expert instead of a time budget", type=int)
    suite: str = option("auto", "data: DS-1000 from data/ds1000/ (auto, ds1000), or the project's sample data",
                        choices=("auto", "ds1000", "sample"))
    rank: int = 8
    """LoRA rank of each expert."""
    lr: float = 1e-2
    """AdamW learning rate (the tiny random model wants a large one)."""
    batch_size: int = 8
    """Examples per step."""
    max_seq_len: int = 128
    """Tokens per example, in training and evaluation."""
    seed: int = 0
    """Seed of every trainer."""
    threshold: float = option(DEFAULT_THRESHOLD, "router confidence below which a prompt goes to the gateway")
    latency_passes: int = 20
    """How many times every held-out prompt is routed to time the router."""
    tune_lam: bool = True
    """Tune each merge's lam on validation (--quick: the defaults)."""

    def __post_init__(self) -> None:
        if not self.seconds_per_expert > 0 or (self.steps is not None and self.steps < 1):
            raise ValueError("--seconds-per-expert must be positive and --steps at least 1")


@dataclass(frozen=True)
class Domain:
    """One specialty's examples, split three ways (see the module docstring)."""

    name: str
    train: list[Example]
    validation: list[Example]
    heldout: list[Example]


@dataclass(frozen=True)
class Adapter:
    """An adapter as the evaluation takes it; tensors None means the base model."""

    tensors: dict[str, torch.Tensor] | None
    lora: dict[str, Any] | None

    def trained(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, lora) of a trained adapter; ValueError for the base model, which has neither."""
        if self.tensors is None or self.lora is None:
            raise ValueError("the base model (Adapter(None, None)) has no LoRA tensors to merge")
        return self.tensors, self.lora


BASE = Adapter(None, None)


def load_domains(suite: str) -> tuple[str, list[Domain]]:
    """DS-1000 as shipped in data/ds1000/ (auto, ds1000), or the project's sample data."""
    if suite in ("auto", "ds1000"):
        return "ds1000", [Domain(d.name, list(d.train), list(d.validation), list(d.heldout)) for d in ds1000_domains()]
    domains = []
    for name in SAMPLE_DOMAINS:
        rest, heldout = split_examples(load_examples(sample_path(name)), 0.1)
        train, validation = split_examples(rest, 0.2)  # every hash left is >= 0.1: [0.1, 0.2)
        domains.append(Domain(name, train, validation, heldout))
    return "sample", domains


def train_experts(domains: Sequence[Domain], settings: Settings) -> tuple[dict[str, Adapter], dict[str, Any]]:
    """One expert per domain, each trained for the same number of steps."""
    experts: dict[str, Adapter] = {}
    steps = settings.steps
    seconds: dict[str, float] = {}
    last_train_loss: dict[str, float] = {}
    for domain in domains:
        trainer = LoraTrainer(load_base_model(BASE_MODEL), LoraSettings(rank=settings.rank),
                              TrainSettings(lr=settings.lr, batch_size=settings.batch_size,
                                            max_seq_len=settings.max_seq_len, seed=settings.seed),
                              domain.train)
        started = time.perf_counter()
        # The first expert trains for the time budget; the others take as many steps as it did.
        done, loss = train_for(trainer, steps, settings.seconds_per_expert)
        steps = done
        seconds[domain.name] = round(time.perf_counter() - started, 2)
        last_train_loss[domain.name] = round(loss, 4)  # mean over the last chunk of steps
        experts[domain.name] = Adapter(trainer.adapter_state(), trainer.lora_config)
        log.info("trained %s: %d steps in %.1f s", domain.name, done, seconds[domain.name])
    return experts, {"steps": steps, "seconds": seconds, "last_train_loss": last_train_loss}


def train_for(trainer: LoraTrainer, steps: int | None, seconds: float) -> tuple[int, float]:
    """Train `steps` steps, or with None as many as fit in `seconds`; (steps, last chunk's loss)."""
    started = time.perf_counter()
    done, loss = 0, math.nan
    if steps is None:
        while done == 0 or time.perf_counter() - started < seconds:
            loss = trainer.train_steps(STEP_CHUNK).loss
            done += STEP_CHUNK
    while steps is not None and done < steps:
        chunk = min(STEP_CHUNK, steps - done)
        loss = trainer.train_steps(chunk).loss
        done += chunk
    return done, loss


def merged_adapter(experts: Mapping[str, Adapter], strategy: str, config: Mapping[str, Any]) -> Adapter:
    """gateway.merges' `strategy` over the experts, weight 1 each, as a PEFT adapter."""
    trained = [e.trained() for e in experts.values()]
    modules = [split_modules(state, alpha=lora["alpha"], rank=lora["rank"]) for state, lora in trained]
    tensors, alpha, rank = merge(strategy, modules, [1.0] * len(modules), **config).state_dict()
    return Adapter(tensors, {"rank": rank, "alpha": alpha, "target_modules": trained[0][1]["target_modules"]})


def naive_factor_average(experts: Mapping[str, Adapter]) -> Adapter:
    """A and B averaged separately: mean(B) @ mean(A) != mean(B @ A), wrong on purpose."""
    trained = [e.trained() for e in experts.values()]
    states = [state for state, _ in trained]
    # sum() from a zero tensor, not from 0: the same additions in the same order, typed as a tensor
    return Adapter({key: sum((s[key] for s in states), torch.zeros_like(states[0][key])) / len(states)
                    for key in states[0]}, dict(trained[0][1]))


def tune_lam(base: BaseModel, domains: Sequence[Domain], experts: Mapping[str, Adapter],
             max_seq_len: int) -> dict[str, dict[str, Any]]:
    """Per merge of MERGE_PLAN (but the average), the lam of LAM_GRID with the best validation R."""
    validation = {d.name: d.validation for d in domains}
    reference = {"base": losses_of(base, BASE, validation, max_seq_len),
                 **{f"expert:{n}": losses_of(base, a, validation, max_seq_len) for n, a in experts.items()}}
    tuned = {}
    for label, (strategy, config) in MERGE_PLAN.items():
        if "lam" not in config:
            continue
        scores = {}
        for lam in LAM_GRID:
            adapter = merged_adapter(experts, strategy, {**config, "lam": lam})
            losses = {**reference, "merge": losses_of(base, adapter, validation, max_seq_len)}
            scores[lam] = statistics.fmean(retained_gains(losses)["merge"].values())
        best = max(scores, key=scores.__getitem__)
        tuned[label] = {"strategy": strategy, "config": {**config, "lam": best},
                        "validation_mean_r": {f"{lam:.4g}": r for lam, r in scores.items()}}
        log.info("%s: lam %.3g is best on validation (mean R %.3f)", label, best, scores[best])
    return tuned


def merged_adapters(experts: Mapping[str, Adapter], tuned: Mapping[str, Mapping[str, Any]]) -> dict[str, Adapter]:
    """The naive factor average, every merge of MERGE_PLAN, and the lam-tuned merges."""
    adapters = {"naive_factor_average": naive_factor_average(experts)}
    for label, (strategy, config) in MERGE_PLAN.items():
        adapters[label] = merged_adapter(experts, strategy, config)
    for label, plan in tuned.items():
        adapters[f"{label} (lam {plan['config']['lam']:.2g})"] = merged_adapter(experts, plan["strategy"],
                                                                                plan["config"])
    return adapters


def answer_tokens(base: BaseModel, examples: Sequence[Example], max_seq_len: int) -> list[int]:
    """Labelled (answer) tokens per example, as the loss counts them."""
    counts = []
    for example in examples:
        _, labels = encode_example(base.tokenizer, example, max_seq_len)
        counts.append(sum(label != IGNORE_INDEX for label in labels[1:]))
    return counts


def routed_loss(base: BaseModel, examples: Sequence[Example], choices: Sequence[str],
                adapters: Mapping[str, Adapter], max_seq_len: int) -> float:
    """Token-weighted loss when each example is answered by the adapter named in `choices`."""
    tokens = answer_tokens(base, examples, max_seq_len)
    total = count = 0.0
    for name in sorted(set(choices)):
        picked = [i for i, choice in enumerate(choices) if choice == name]
        adapter = adapters[name]
        loss = adapter_loss(base, [examples[i] for i in picked], adapter.tensors, adapter.lora, max_seq_len)
        n = sum(tokens[i] for i in picked)
        total += loss * n
        count += n
    return total / count


def run_router(domains: Sequence[Domain], settings: Settings) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """Route every held-out prompt; the choice per example (expert name or GATEWAY) and stats."""
    started = time.perf_counter()
    profiles = {d.name: text_profile(e.prompt for e in d.train) for d in domains}
    profile_seconds = time.perf_counter() - started
    choices, truth, predicted = {}, [], []
    for domain in domains:
        results = [route(e.prompt, profiles, settings.threshold) for e in domain.heldout]
        choices[domain.name] = [r.expert or GATEWAY for r in results]
        truth += [domain.name] * len(results)
        predicted += [r.expert for r in results]
    prompts = [e.prompt for d in domains for e in d.heldout]
    wall, cpu = [], []
    for _ in range(settings.latency_passes):
        for prompt in prompts:
            t, c = time.perf_counter(), time.thread_time()
            route(prompt, profiles, settings.threshold)
            cpu.append((time.thread_time() - c) * 1e3)
            wall.append((time.perf_counter() - t) * 1e3)
    stats = {
        **classification_scores(truth, predicted, [d.name for d in domains]),
        "threshold": settings.threshold,
        # Wall-clock includes time spent waiting for a core on a busy machine; CPU time does not.
        "latency_ms": {"mean": statistics.fmean(wall), "p50": float(np.percentile(wall, 50)),
                       "p99": float(np.percentile(wall, 99)), "routes_timed": len(wall)},
        "cpu_ms": {"mean": statistics.fmean(cpu), "p50": float(np.percentile(cpu, 50)),
                   "p99": float(np.percentile(cpu, 99))},
        "load_average_1min": os.getloadavg()[0],
        "profile_seconds": profile_seconds,
        "mean_prompt_bytes": statistics.fmean(len(p.encode()) for p in prompts),
    }
    return choices, stats


def classification_scores(truth: Sequence[str], predicted: Sequence[str | None],
                          labels: Sequence[str]) -> dict[str, Any]:
    """Accuracy and macro-F1 over the experts; a prompt sent to the gateway is a miss."""
    per_class = {}
    for label in labels:
        tp = sum(t == label and p == label for t, p in zip(truth, predicted))
        fp = sum(t != label and p == label for t, p in zip(truth, predicted))
        fn = sum(t == label and p != label for t, p in zip(truth, predicted))
        precision = tp / (tp + fp) if tp + fp else 0.0
        recall = tp / (tp + fn) if tp + fn else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        per_class[label] = {"precision": precision, "recall": recall, "f1": f1, "support": tp + fn}
    confusion = {t: {p or GATEWAY: sum(a == t and b == p for a, b in zip(truth, predicted))
                     for p in [*labels, None]} for t in labels}
    return {
        "accuracy": sum(t == p for t, p in zip(truth, predicted)) / len(truth),
        "macro_f1": statistics.fmean(c["f1"] for c in per_class.values()),
        "to_gateway": sum(p is None for p in predicted) / len(predicted),
        "per_class": per_class,
        "confusion": confusion,
    }


def losses_of(base: BaseModel, adapter: Adapter, examples: Mapping[str, Sequence[Example]],
              max_seq_len: int) -> dict[str, float]:
    """Loss of one adapter on each domain's examples."""
    return {name: adapter_loss(base, list(exs), adapter.tensors, adapter.lora, max_seq_len)
            for name, exs in examples.items()}


def evaluate(base: BaseModel, domains: Sequence[Domain], experts: Mapping[str, Adapter],
             merged: Mapping[str, Adapter], router_choices: Mapping[str, list[str]],
             max_seq_len: int) -> dict[str, dict[str, float]]:
    """Held-out loss per method per domain."""
    fixed = {"base": BASE, **{f"expert:{name}": a for name, a in experts.items()}, **merged}
    heldout = {d.name: d.heldout for d in domains}
    losses: dict[str, dict[str, float]] = {}
    for label, adapter in fixed.items():
        losses[label] = losses_of(base, adapter, heldout, max_seq_len)
        log.info("evaluated %s", label)
    losses["router"] = {d.name: routed_loss(base, d.heldout, router_choices[d.name], {**experts, **merged},
                                            max_seq_len) for d in domains}
    losses["oracle_router"] = {d.name: losses[f"expert:{d.name}"][d.name] for d in domains}
    return losses


def retained_gains(losses: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """R(d) = (L_base - L_method) / (L_base - L_expert_d) per method and domain."""
    base = losses["base"]
    gains = {}
    for method, per_domain in losses.items():
        gains[method] = {d: (base[d] - loss) / (base[d] - losses[f"expert:{d}"][d])
                         for d, loss in per_domain.items()}
    return gains


def check_targets(gains: Mapping[str, Mapping[str, float]], router: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with whether it was met and the numbers behind it."""
    mean = {m: statistics.fmean(g.values()) for m, g in gains.items()}
    merges = [m for m in gains if m.split(" ")[0] in MERGE_PLAN and m != GATEWAY]
    best = max(merges, key=mean.__getitem__)
    exact = gains[GATEWAY]
    worse = [d for d in exact if gains[best][d] < exact[d]]
    return [
        {"target": "exact average beats the naive factor average (mean R)",
         "met": mean[GATEWAY] > mean["naive_factor_average"],
         "detail": f"{mean[GATEWAY]:.3f} vs {mean['naive_factor_average']:.3f}"},
        {"target": "best merge's mean R >= exact average's + 0.10, no domain worse",
         "met": mean[best] >= mean[GATEWAY] + 0.10 and not worse,
         "detail": f"{best} {mean[best]:.3f} vs {mean[GATEWAY]:.3f}; worse on: {worse or 'none'}"},
        {"target": "router macro-F1 >= 0.95", "met": router["macro_f1"] >= 0.95,
         "detail": f"{router['macro_f1']:.3f}"},
        {"target": "router mean R >= 0.95", "met": mean["router"] >= 0.95, "detail": f"{mean['router']:.3f}"},
        {"target": "router under 1 ms per prompt (wall-clock mean and p99)",
         "met": router["latency_ms"]["mean"] < 1 and router["latency_ms"]["p99"] < 1,
         "detail": f"mean {router['latency_ms']['mean']:.3f} ms, p99 {router['latency_ms']['p99']:.3f} ms; "
                   f"CPU time mean {router['cpu_ms']['mean']:.3f} ms, p99 {router['cpu_ms']['p99']:.3f} ms; "
                   f"load average {router['load_average_1min']:.1f} on {os.cpu_count()} cores"},
    ]


def format_table(losses: Mapping[str, Mapping[str, float]], gains: Mapping[str, Mapping[str, float]]) -> str:
    domains = list(losses["base"])
    headers = ["method"] + [f"loss {d}" for d in domains] + [f"R {d}" for d in domains] + ["mean R"]
    rows = []
    for method in losses:
        mean = statistics.fmean(gains[method].values())
        rows.append([method] + [f"{losses[method][d]:.3f}" for d in domains]
                    + [f"{gains[method][d]:.3f}" for d in domains] + [f"{mean:.3f}"])
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def run(s: Settings, ctx: Run) -> int:
    if not ctx.verbose:
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    suite, domains = load_domains(s.suite)
    log.info("suite %s (train+validation+held-out): %s", suite,
             ", ".join(f"{d.name} {len(d.train)}+{len(d.validation)}+{len(d.heldout)}" for d in domains))

    experts, training = train_experts(domains, s)
    base = load_base_model(BASE_MODEL)
    tuned = tune_lam(base, domains, experts, s.max_seq_len) if s.tune_lam else {}
    merged = merged_adapters(experts, tuned)
    router_choices, router = run_router(domains, s)
    losses = evaluate(base, domains, experts, merged, router_choices, s.max_seq_len)
    gains = retained_gains(losses)
    targets = check_targets(gains, router)

    print(f"\nheld-out loss and retained gain R per domain ({suite}, {training['steps']} steps per expert)\n")
    print(format_table(losses, gains))
    print(f"\nrouter: accuracy {router['accuracy']:.3f}, macro-F1 {router['macro_f1']:.3f}, "
          f"{router['to_gateway']:.1%} to the gateway; per prompt {router['latency_ms']['mean']:.3f} ms mean, "
          f"{router['latency_ms']['p99']:.3f} ms p99 wall-clock ({router['cpu_ms']['p99']:.3f} ms p99 CPU time)")
    for t in targets:
        print(f"[{'met' if t['met'] else 'NOT met'}] {t['target']}: {t['detail']}")
    print(f"\n{ctx.seconds():.0f} s in all")

    ctx.write({
        "benchmark": "gateway", "suite": suite, "base_model": BASE_MODEL, "quick": ctx.quick,
        "settings": asdict(s),
        "domains": {d.name: {"train": len(d.train), "validation": len(d.validation), "heldout": len(d.heldout)}
                    for d in domains},
        "training": training,
        "merges": {label: {"strategy": k, "config": c, "weights": "1 per expert"}
                   for label, (k, c) in MERGE_PLAN.items()},
        "lam_tuned_on_validation": tuned,
        "gateway_fallback": GATEWAY,
        "losses": losses,
        "retained_gain": gains,
        "mean_retained_gain": {m: statistics.fmean(g.values()) for m, g in gains.items()},
        "router": router,
        "targets": targets,
        "seconds": ctx.seconds(),
        "torch_threads": torch.get_num_threads(),
    })
    log.info("wrote %s", ctx.out)
    return 0


BENCH = Bench("gateway", tags=("robustness",), settings=Settings, run=run,
              quick={"seconds_per_expert": 5.0, "latency_passes": 5, "tune_lam": False})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
