#!/usr/bin/env python3
"""Gateway quality on a real model: merges, the router and its calibrated threshold (smollm2-135m, DS-1000).

Per training seed, one expert per DS-1000 domain (numpy, pandas, sklearn) is trained in this
process with the real LoraTrainer (LoRA r=8, lr 1e-3, batch 4 x <= 128 tokens). Every method is
scored by the held-out answer-token loss per domain and by the retained gain

    R(d) = (L_base(d) - L_method(d)) / (L_base(d) - L_expert_d(d)),

with and without the end-of-answer token. Methods: each expert, the naive factor average (A and
B averaged separately: the known-wrong one), the exact equal-weight average (the coordinator's
gateway), task arithmetic, TIES, DARE and DARE-TIES with lam tuned on the *validation* split
(bench.realdata: carved from train/ by whole problem families) on seed 0's experts (and scored
on seed 0 only: no target hangs on them), the router
(each held-out prompt to the expert gateway.router picks on profiles of the training prompts, or
to the exact average when unsure) at the shipped threshold and at the one fitted on validation
(gateway.router.fit_threshold: the cut that maximises the validation loss saved by routing), and
the oracle router.

The experts' true deltas also give each codec's relative error and cosine on a whole expert's
update (``codec_true_delta``; the compression suite measures codecs in training).

    python -m bench.quality_gateway            # smollm2-135m (make smollm2)
    python -m bench.quality_gateway --quick    # tiny-qwen2 smoke run
"""
from __future__ import annotations

import json
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


from bench.common import format_table
from bench.harness import Bench, Run
from protocol.cli import option
from bench.gateway import MERGE_PLAN, Adapter, classification_scores, merged_adapter, naive_factor_average
from bench.quality_compression import true_delta_figures
from bench.realdata import (REAL_MODEL, SMOKE_MODEL, Estimate, Lab, RealDomain, ds1000_domains, heldout_size,
                            planned_cost, quiet_estimate, render_plan, spread)
from bench.mixtures import MIXTURE_ROW, pass_at_1_table, render_soft, soft_methods, wrong_expert_cost
from protocol.profiles import text_profile
from gateway.router import DEFAULT_THRESHOLD, fit_threshold, fit_threshold_counting_mistakes, route
from worker.evaluation import AnswerLoss, total

log = logging.getLogger("bench.quality_gateway")
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

GATEWAY = "exact_average"
OLD_THRESHOLD = 0.7
"""The threshold shipped before this calibration (issue 15: it sent right-top-score prompts to the gateway)."""
Losses = dict[str, dict[int, AnswerLoss]]
"""Per domain, the AnswerLoss of each example evaluated (by index in the split)."""


TUNABLE_MERGES = tuple(m for m, (_, config) in MERGE_PLAN.items() if "lam" in config)


@dataclass(frozen=True)
class Settings(Estimate):
    model: str = REAL_MODEL
    steps: int = option(12, "optimiser steps per expert (batch 4 x <= 128 tokens)")
    seeds: int = option(3, "training seeds")
    lam_grid: tuple[float, ...] = option((0.25, 0.5, 1.0), "lam values each merge is tuned over on validation (lam "
                                         "1/3 of the sum of 3 would be the average)", nargs="+", type=float)
    merges: tuple[str, ...] = option(("ties", "dare_ties"), "merges tuned and scored besides the exact and naive "
                                     "averages", nargs="+", choices=TUNABLE_MERGES)
    """Merges of bench.gateway.MERGE_PLAN. TIES and DARE-TIES by default (time budget): on 2026-11-24 (seed 0) they
    retained 0.960 / 0.967 against the exact average's 0.945, task arithmetic and DARE 0.938 / 0.933."""
    tune_limit: int | None = option(8, "validation problems per domain the merges' lam is tuned on (the router "
                                    "always uses all)")
    arrow: bool = option(True, "skip PEFT's Arrow routing (two models per domain)", flag="--no-arrow")
    pass_problems: int | None = option(None, "held-out problems per domain whose generated answers are executed for "
                                       "pass@1, seed 0 (default: all)", type=int)
    pass_tokens: int = 64
    """Longest generated answer for pass@1, in tokens."""
    router_only: bool = option(False, "only fit the router's threshold on validation (no model; seconds), into "
                               "router_calibration.json beside --out")

    def __post_init__(self) -> None:
        for name in ("steps", "seeds", "tune_limit", "pass_problems"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


QUICK = {"model": SMOKE_MODEL, "steps": 3, "seeds": 1, "lam_grid": (0.5,), "pass_problems": 1, "pass_tokens": 8}


def estimate(s: Settings, measured: Path, last: Path) -> dict[str, Any]:
    """Optimiser steps and scored problems of the run, priced from ``measured``; validation sizes come from
    ``last`` (this suite's results; else the split is built). Prompts the router sends to another domain's
    expert add a few; pass@1's generation and sandboxed runs are not priced."""
    try:
        sizes = json.loads(last.read_text())["domains"]
        val = {d: int(v["validation"]) for d, v in sizes.items()}
    except (OSError, ValueError, KeyError, TypeError):
        val = {d.name: len(d.validation) for d in ds1000_domains()}
    held = sum(heldout_size(d) for d in val)
    per_seed = 2 * sum(val.values()) + 3 * held  # experts and the exact average on validation; + naive on held-out
    per_seed += (2 + 4 + (4 if s.arrow else 0)) * held  # mixtures; leave-one-out's four; Arrow with/without GKS, twice
    wrong_cost = 4 * sum(val.values())  # seed 0: the gateway and every expert on every validation problem
    tuning = len(s.merges) * (len(s.lam_grid) * sum(min(n, s.tune_limit or n) for n in val.values()) + held)
    return planned_cost(s.seeds * len(val) * s.steps,
                        held + sum(val.values()) + s.seeds * per_seed + tuning + wrong_cost, measured)


def train_experts(lab: Lab, domains: Sequence[RealDomain], steps: int, seed: int) -> tuple[dict[str, Adapter], list]:
    experts, deltas = {}, []
    for d in domains:
        trainer = lab.trainer(d.train, seed)
        start = trainer.adapter_state()
        lab.train(trainer, steps)
        state = trainer.adapter_state()
        experts[d.name] = Adapter(state, trainer.lora_config)
        deltas.append({k: state[k] - start[k] for k in state})
        log.info("seed %d: trained %s (%d steps)", seed, d.name, steps)
    return experts, deltas


def split_losses(lab: Lab, adapter: Adapter, split: Mapping[str, Sequence],
                 only: Mapping[str, Sequence[int]] | None = None) -> Losses:
    """Per domain, the loss of each example (all of them, or the indices in ``only``)."""
    out: Losses = {}
    for name, examples in split.items():
        indices = list(range(len(examples))) if only is None else sorted(set(only.get(name, ())))
        out[name] = dict(zip(indices, lab.losses([examples[i] for i in indices], adapter.tensors, adapter.lora)
                             if indices else []))
    return out


def expert_losses(lab: Lab, experts: Mapping[str, Adapter], split: Mapping[str, Sequence],
                  top: Sequence[str | None]) -> dict[str, Losses]:
    """Each expert on all of its own domain and on the other domains' prompts the router sends it."""
    flat = [(d, i) for d, examples in split.items() for i in range(len(examples))]
    out = {}
    for name, adapter in experts.items():
        only = {d: list(range(len(examples))) if d == name else [i for (dd, i), t in zip(flat, top)
                                                                  if dd == d and t == name]
                for d, examples in split.items()}
        out[f"expert:{name}"] = split_losses(lab, adapter, split, only)
    return out


def mean_loss(losses: Mapping[int, AnswerLoss], without_end: bool = False) -> float:
    summed = total(list(losses.values()))
    return summed.mean_without_end if without_end else summed.mean


def retained(method: Losses, base: Losses, experts: Mapping[str, Losses], without_end: bool) -> dict[str, float]:
    return {d: (mean_loss(base[d], without_end) - mean_loss(method[d], without_end))
            / (mean_loss(base[d], without_end) - mean_loss(experts[f"expert:{d}"][d], without_end)) for d in base}


def tune(lab: Lab, experts: Mapping[str, Adapter], base_val: Losses, expert_val: Mapping[str, Losses],
         validation: Mapping[str, Sequence], grid: Sequence[float], merges: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per merge of ``merges``, the lam of ``grid`` with the best mean validation R."""
    tuned: dict[str, dict[str, Any]] = {}
    for label in merges:
        strategy, config = MERGE_PLAN[label]
        scores: dict[float, float] = {}
        for lam in grid:
            losses = split_losses(lab, merged_adapter(experts, strategy, {**config, "lam": lam}), validation)
            scores[lam] = statistics.fmean(retained(losses, base_val, expert_val, False).values())
        best = max(scores, key=scores.__getitem__)
        tuned[label] = {"strategy": strategy, "config": {**config, "lam": best}, "validation_mean_r": scores}
        log.info("%s: lam %.3g best on validation (mean R %.3f)", label, best, scores[best])
    return tuned


Routes = tuple[list[str], list[str | None], list[float]]
"""``routing``'s answer for one split: true domain, top expert and confidence per prompt."""


def routing(domains: Sequence[RealDomain], split: str) -> Routes:
    """(truth, top expert, confidence) per prompt of ``split``, routed on the training prompts' profiles.

    The top expert is None (confidence 0) for a prompt too short to compare (gateway.router.route).
    """
    profiles = {d.name: text_profile(e.prompt for e in d.train) for d in domains}
    truth: list[str] = []
    top: list[str | None] = []
    confidence: list[float] = []
    for d in domains:
        for e in getattr(d, split):
            result = route(e.prompt, profiles, 0.0)
            truth.append(d.name)
            top.append(result.expert)
            confidence.append(result.confidence)
    return truth, top, confidence


def calibrate_router(domains: Sequence[RealDomain]) -> dict[str, Any]:
    """The router's threshold fitted on the validation split (model-free: +1 per right top expert,
    -1 per wrong one; floor 1 / experts), and what it and the old 0.7 do on the held-out prompts."""
    truth_v, top_v, conf_v = routing(domains, "validation")
    fitted = round(fit_threshold(conf_v, [1.0 if t == p else -1.0 for t, p in zip(truth_v, top_v)],
                                 floor=1 / len(domains)), 2)
    truth, top, confidence = routing(domains, "heldout")
    names = [d.name for d in domains]
    heldout = {}
    for label, threshold in (("fitted", fitted), ("old_0.7", OLD_THRESHOLD)):
        predicted = [e if c >= threshold else None for e, c in zip(top, confidence)]
        heldout[label] = {"threshold": threshold, **classification_scores(truth, predicted, names),
                          "right_top_sent_to_gateway": sum(t == e and p is None
                                                           for t, e, p in zip(truth, top, predicted))}
    return {"fitted_threshold": fitted, "rule": "max over cuts of (right - wrong) routed validation prompts; "
            "all routed: midway to 1/experts", "validation": {"prompts": len(conf_v), "top1_accuracy":
            statistics.fmean(t == p for t, p in zip(truth_v, top_v)), "wrong_top_confidences": sorted(
                round(c, 3) for t, p, c in zip(truth_v, top_v, conf_v) if t != p),
            "lowest_confidence": round(min(conf_v), 3)},
            "heldout": heldout, "heldout_top1_accuracy": statistics.fmean(t == p for t, p in zip(truth, top))}


def render_calibration(calibration: Mapping[str, Any]) -> str:
    lines = [f"router threshold fitted on validation ({calibration['validation']['prompts']} prompts, top-1 "
             f"{calibration['validation']['top1_accuracy']:.3f}): {calibration['fitted_threshold']:.2f}"]
    for label, r in calibration["heldout"].items():
        lines.append(f"  held-out at {r['threshold']:.2f} ({label}): accuracy {r['accuracy']:.3f}, macro-F1 "
                     f"{r['macro_f1']:.3f}, {r['to_gateway']:.1%} to the gateway, "
                     f"{r['right_top_sent_to_gateway']} with a right top expert sent there")
    return "\n".join(lines)


def routed(choices: Sequence[str], per_method: Mapping[str, Losses], domains: Sequence[str]) -> Losses:
    """Per domain, each example's loss under the adapter named by its choice (in the routing order)."""
    out: Losses = {d: {} for d in domains}
    flat = [(d, i) for d in domains for i in range(len(per_method["base"][d]))]
    for (d, i), choice in zip(flat, choices):
        out[d][i] = per_method[choice][d][i]
    return out


def run_suite(lab: Lab, domains: Sequence[RealDomain], s: Settings,
              on_seed: Callable[[dict[str, Any], int], None] = lambda report, done: None) -> dict[str, Any]:
    """Train and score every seed; after each seed ``on_seed(report so far, seeds done)``, so a long run that is
    stopped keeps what it measured."""
    names = [d.name for d in domains]
    heldout = {d.name: d.heldout for d in domains}
    validation = {d.name: d.validation for d in domains}
    base = Adapter(None, None)
    base_held, base_val = split_losses(lab, base, heldout), split_losses(lab, base, validation)
    routes_v, routes_h = routing(domains, "validation"), routing(domains, "heldout")
    top_v, top_h = routes_v[1], routes_h[1]
    gains = [0.0] * len(top_v)
    per_seed, per_seed_lodo, deltas, tuned, soft_report = [], [], [], {}, {}
    for seed in range(s.seeds):
        experts, seed_deltas = train_experts(lab, domains, s.steps, seed)
        deltas += seed_deltas
        val = expert_losses(lab, experts, validation, top_v)
        val[GATEWAY] = split_losses(lab, merged_adapter(experts, "weighted_average", {}), validation)
        val["base"] = base_val
        if seed == 0:
            subset = {d: list(v[:s.tune_limit]) for d, v in validation.items()}
            sub_val = {m: {d: {i: x for i, x in per.items() if i < len(subset[d])} for d, per in losses.items()}
                       for m, losses in val.items()}
            tuned = tune(lab, experts, sub_val["base"], sub_val, subset, s.lam_grid, s.merges)
        for i, gain in enumerate(routing_gains(top_v, val, names)):
            gains[i] += gain
        methods = {"base": base_held, **expert_losses(lab, experts, heldout, top_h),
                   "naive_factor_average": split_losses(lab, naive_factor_average(experts), heldout),
                   GATEWAY: split_losses(lab, merged_adapter(experts, "weighted_average", {}), heldout)}
        for label, plan in tuned.items() if seed == 0 else ():  # merges decide no target: seed 0 only
            methods[f"{label} (lam {plan['config']['lam']:.2g})"] = split_losses(
                lab, merged_adapter(experts, plan["strategy"], plan["config"]), heldout)
        full, lodo, mixlab, soft_report["router_mistakes"] = soft_methods(lab, experts, domains, DEFAULT_THRESHOLD,
                                                                          s.arrow)
        methods.update(full)
        per_seed.append(methods)
        per_seed_lodo.append({"base": base_held, **lodo})
        if seed == 0:
            soft_report["wrong_expert"] = wrong_expert_cost(mixlab, domains)
            soft_report["pass_at_1"] = pass_at_1_table(mixlab, domains, DEFAULT_THRESHOLD, s.pass_problems,
                                                       s.pass_tokens)
        log.info("seed %d evaluated", seed)
        report = assemble(domains, routes_v, routes_h, per_seed, per_seed_lodo, soft_report, gains, tuned, deltas)
        on_seed(report, seed + 1)
    return report


def assemble(domains: Sequence[RealDomain], routes_v: Routes, routes_h: Routes,
             per_seed: Sequence[Mapping[str, Losses]], per_seed_lodo: Sequence[Mapping[str, Losses]],
             soft_report: dict[str, Any], gains: Sequence[float], tuned: Mapping[str, Any],
             deltas: Sequence[Any]) -> dict[str, Any]:
    """The report over the seeds scored so far (model-free: seconds)."""
    names = [d.name for d in domains]
    (truth_v, top_v, conf_v), (truth_h, top_h, conf_h) = routes_v, routes_h
    fitted = round(fit_threshold(conf_v, gains, floor=1 / len(domains)), 2)
    report = summarize(per_seed, names, truth_h, top_h, conf_h, fitted)
    report["leave_one_out"] = {m: {d: spread([mean_loss(seed[m][d]) for seed in per_seed_lodo])
                                   for d in names} for m in per_seed_lodo[0]}
    wrong_cost = soft_report["wrong_expert"]["wrong_cost"]
    soft_report["wrong_expert"]["threshold"] = round(fit_threshold_counting_mistakes(
        conf_v, [t == p for t, p in zip(truth_v, top_v)], min(wrong_cost, 1e6), floor=1 / len(domains)), 2)
    report["soft"] = soft_report
    report["targets"] += auto_targets(report, names)
    report["router"]["validation"] = {"prompts": len(conf_v), "top1_accuracy": statistics.fmean(
        t == p for t, p in zip(truth_v, top_v)), "fitted_threshold": fitted,
        "gain_nats_routed_at_fitted": sum(g for g, c in zip(gains, conf_v) if c >= fitted)}
    report["lam_tuned_on_validation"] = dict(tuned)
    report["router"]["calibration"] = calibrate_router(domains)
    report["codec_true_delta"] = true_delta_figures(deltas)
    return report


def auto_targets(report: Mapping[str, Any], names: Sequence[str]) -> list[dict[str, Any]]:
    """The top-3 mixture (the candidate for serving's auto) against the better of gateway and routing, per domain."""
    out = []
    shipped = {m: {d: v["loss"][d]["mean"] for d in names} for m, v in report["methods"].items()}
    router = f"router (threshold {DEFAULT_THRESHOLD:.2f})"
    lodo = {m: {d: v[d]["mean"] for d in names} for m, v in report["leave_one_out"].items()}
    for label, table, gateway, routed_label in (("shipped domains", shipped, GATEWAY, router),
                                                ("leave one domain out", lodo, "gateway", "routed")):
        auto, better = table[MIXTURE_ROW], {d: min(table[gateway][d], table[routed_label][d]) for d in names}
        worst = max(auto[d] - better[d] for d in names)
        mean_gap = statistics.fmean(auto[d] for d in names) - min(statistics.fmean(table[m][d] for d in names)
                                                                 for m in (gateway, routed_label))
        out.append({"target": f"top-3 mixture <= min(gateway, routed) on every domain, lower on average ({label})",
                    "met": worst <= 0 and mean_gap < 0,
                    "detail": f"worst domain {worst:+.4f}, mean {mean_gap:+.4f} nats per token"})
    return out


def routing_gains(top: Sequence[str | None], val: Mapping[str, Losses], names: Sequence[str]) -> list[float]:
    """Per validation prompt: the gateway's summed nll minus its top expert's (nats saved by routing it).

    A prompt with no top expert (too short to compare) can only go to the gateway: it saves nothing.
    """
    flat = [(d, i) for d in names for i in range(len(val["base"][d]))]
    return [0.0 if e is None else val[GATEWAY][d][i].nll - val[f"expert:{e}"][d][i].nll for (d, i), e in zip(flat, top)]


def summarize(per_seed: Sequence[Mapping[str, Losses]], names: Sequence[str], truth: Sequence[str],
              top: Sequence[str | None], confidence: Sequence[float], fitted: float) -> dict[str, Any]:
    thresholds = {"fitted on losses": fitted, "default": DEFAULT_THRESHOLD, "old_0.7": OLD_THRESHOLD}
    choices = {k: [f"expert:{e}" if c >= t else GATEWAY for e, c in zip(top, confidence)]
               for k, t in thresholds.items()}
    methods: dict[str, dict[str, Any]] = {}
    for seed_methods in per_seed:
        experts = {m: v for m, v in seed_methods.items() if m.startswith("expert:")}
        table = {m: v for m, v in seed_methods.items() if not m.startswith("expert:")}  # only partly evaluated
        for k, chosen in choices.items():
            table[f"router (threshold {thresholds[k]:.2f})"] = routed(chosen, seed_methods, names)
        table["oracle_router"] = {d: seed_methods[f"expert:{d}"][d] for d in names}
        for method, losses in table.items():
            entry = methods.setdefault(method, {"loss": {d: [] for d in names}, "loss_without_end": {d: [] for d in names},
                                                "mean_r": [], "mean_r_without_end": []})
            for d in names:
                entry["loss"][d].append(mean_loss(losses[d]))
                entry["loss_without_end"][d].append(mean_loss(losses[d], True))
            entry["mean_r"].append(statistics.fmean(retained(losses, seed_methods["base"], experts, False).values()))
            entry["mean_r_without_end"].append(statistics.fmean(
                retained(losses, seed_methods["base"], experts, True).values()))
    summary = {m: {"loss": {d: spread(v) for d, v in e["loss"].items()},
                   "loss_without_end": {d: spread(v) for d, v in e["loss_without_end"].items()},
                   "mean_r": spread(e["mean_r"]), "mean_r_without_end": spread(e["mean_r_without_end"])}
               for m, e in methods.items()}
    router = {k: {"threshold": t, **classification_scores(
        truth, [e if c >= t else None for e, c in zip(top, confidence)], list(names))} for k, t in thresholds.items()}
    fitted_r = summary[f"router (threshold {DEFAULT_THRESHOLD:.2f})"]["mean_r"]
    return {"methods": summary, "router": {"heldout": router, "top1_accuracy": statistics.fmean(
        t == p for t, p in zip(truth, top))},
        "targets": [
            {"target": "router mean R >= 0.95 (default threshold, mean over seeds)", "met": fitted_r["mean"] >= 0.95,
             "detail": f"{fitted_r['mean']:.3f} (min {fitted_r['min']:.3f}, n={fitted_r['n']})"},
            {"target": "router macro-F1 >= 0.95 (default threshold)", "met": router["default"]["macro_f1"] >= 0.95,
             "detail": f"{router['default']['macro_f1']:.3f}"},
            {"target": "exact average beats the naive factor average (mean R)",
             "met": summary[GATEWAY]["mean_r"]["mean"] > summary["naive_factor_average"]["mean_r"]["mean"],
             "detail": f"{summary[GATEWAY]['mean_r']['mean']:.3f} vs "
                       f"{summary['naive_factor_average']['mean_r']['mean']:.3f}"}]}


def render(report: Mapping[str, Any], names: Sequence[str]) -> str:
    rows = []
    for method, m in report["methods"].items():
        rows.append([method, *[f"{m['loss'][d]['mean']:.4f}" for d in names],
                     *[f"{m['loss_without_end'][d]['mean']:.4f}" for d in names],
                     f"{m['mean_r']['mean']:.3f} +/- {m['mean_r']['std']:.3f}",
                     f"{m['mean_r_without_end']['mean']:.3f}"])
    headers = ["method", *[f"loss {d.split('_')[0]}" for d in names], *[f"w/o end {d.split('_')[0]}" for d in names],
               "mean R (seeds)", "R w/o end"]
    lines = [format_table(headers, rows, align="l" + "r" * (len(headers) - 1)), ""]
    for k, r in report["router"]["heldout"].items():
        lines.append(f"router {k} threshold {r['threshold']:.2f}: accuracy {r['accuracy']:.3f}, macro-F1 "
                     f"{r['macro_f1']:.3f}, {r['to_gateway']:.1%} to the gateway")
    lines.append(render_calibration(report["router"]["calibration"]))
    lines.append(render_soft(report, names))
    for t in report["targets"]:
        lines.append(f"[{'met' if t['met'] else 'NOT met'}] {t['target']}: {t['detail']}")
    return "\n".join(lines)


def run(s: Settings, ctx: Run) -> int:
    if s.estimate:
        print(render_plan("bench.quality_gateway", estimate(s, s.priced_from or ctx.out, ctx.out)))
        return 0
    started = time.perf_counter()
    domains = ds1000_domains()
    if s.router_only:
        calibration = {"benchmark": "router_calibration", "data": "data/ds1000 (validation carved from train/)",
                       **calibrate_router(domains)}
        ctx.write(calibration, ctx.out.with_name("router_calibration.json"))
        print(render_calibration(calibration))
        return 0
    lab = Lab(s.model)
    names = [d.name for d in domains]

    def document(report: Mapping[str, Any], seeds_done: int) -> dict[str, Any]:
        return {"benchmark": "quality_gateway", "base_model": s.model, "quick": ctx.quick, "settings": asdict(s),
                "seeds_done": seeds_done,
                "domains": {d.name: {"train": len(d.train), "validation": len(d.validation),
                                     "heldout": len(d.heldout)} for d in domains},
                **report, "cost": quiet_estimate(lab.compute, time.perf_counter() - started)}

    def checkpoint(report: dict[str, Any], seeds_done: int) -> None:
        if seeds_done < s.seeds:  # the last seed's document is written below, as the result
            ctx.write(document(report, seeds_done), partial_path(ctx.out))
            log.info("seed %d of %d: partial results in %s", seeds_done, s.seeds, partial_path(ctx.out))

    out = document(run_suite(lab, domains, s, checkpoint), s.seeds)
    ctx.write(out)
    partial_path(ctx.out).unlink(missing_ok=True)
    print(render(out, names))
    log.info("wrote %s", ctx.out)
    return 0


def partial_path(out: Path) -> Path:
    """Where a run keeps the seeds it has scored so far (removed when the run completes)."""
    return out.with_name(out.stem + ".partial.json")


BENCH = Bench("quality_gateway", tags=("quality",), settings=Settings, run=run, quick=QUICK, cores=1)
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
