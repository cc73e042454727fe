#!/usr/bin/env python3
"""Adaptive compression benchmark: --compression auto against fixed codecs over one throttled link.

Workers training one expert sit in an emulated site (``bench.wanemu``: a network namespace behind
a tbf-shaped veth and a delay proxy); the coordinator runs on this host's loopback. Every
configuration runs the same federated job: ``--workers`` in-process FederatedWorkers (one driver
process inside the site, so all their traffic crosses the link), ``--rounds`` rounds of
``--steps`` training steps then a sync per worker, no final flush (so the expert holds what the
codec delivered, not everything trained). Configurations, in order:

- ``auto``: ``--compression auto --sync-budget B`` (codec per sync from the measured upload rate,
  compressed diff pulls when full weights would overrun the budget);
- ``randomk+terngrad same bytes``: auto's last rung as a fixed codec (unbiased random-k + TernGrad,
  no error feedback, each worker its own selection seed as auto does) at the ratio whose pushes are,
  on average, as large as auto's were;
- ``topk+int8 same bytes``: top-k + int8 with error feedback (auto's last rung until 2026-11) at the
  ratio of the same mean push size;
- ``int4``, ``int8`` and ``safetensors``: the fixed dense codecs (auto's dense rungs; int4, ~0.57 bytes a
  parameter, is near auto's size on a slow link, so it counts as "of the same size" when its mean push is
  within ``SAME_SIZE`` of auto's).

Reported per configuration: held-out loss of the expert as the coordinator holds it, bytes pushed
and pulled, push and pull seconds (median, and the share of pushes within the budget), the codecs
used, and the bytes that crossed the link (counted by the proxy).

With ``--seeds N`` every configuration runs on seeds 0..N-1 (LoRA init, data order and random-k
selections change with the seed) and the table shows each codec's bytes a push against auto's and
fp32's, pushes within the budget, held-out loss mean +/- std with and without the end token, and
the paired difference auto minus it on the same seed; the verdict compares auto with the best fixed
codec whose mean push is at most ``SAME_SIZE`` x auto's. The fixed codecs are deterministic per
seed; auto is not (its codecs follow the push times it measures).

    python -m bench.adaptive --quick                  # tiny-qwen2, 2 workers x 4 rounds, ~15 min on a loaded 2-core machine
    python -m bench.adaptive --base-model smollm2-135m --rate-mbit 20 --budget 2 --lora-rank 8 --rounds 6 --seeds 3
    # then top-k + int8 at more ratios on the same seeds, keeping every row of the first run:
    python -m bench.adaptive ... --seeds 3 --fixed-from FIRST.json --extra-only --topk-ratios 0.285

Needs root (network namespaces). Table on stdout, progress on stderr, results in
bench/results/adaptive.json.
"""
from __future__ import annotations

import dataclasses
import json
import math
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import SCRATCH_DIR, format_table, recorded_token, running_coordinator, sample_path
from bench.harness import Bench, Run
from bench.wanemu import NamespaceUnavailable, WanLink, check_available
from protocol.cli import option
from protocol.credentials import TOKEN_ENV
from worker.adaptive import LOSSY, RAW_BYTES, TOPK_INT8, SparseRung, ratio_of

log = logging.getLogger("bench.adaptive")
ROOT = Path(__file__).resolve().parents[1]
SPECIALTY = "sql_expert"
SAME_SIZE = 1.5
"""A fixed codec whose mean push is within this factor of auto's (either way) counts as one of its size."""


@dataclass(frozen=True)
class Settings:
    base_model: str = "tiny-qwen2"
    workers: int = 2
    """In-process workers of the one expert (one driver process in the site)."""
    rounds: int = 4
    """Syncs per worker."""
    steps: int = 2
    """Training steps of each worker between its syncs."""
    rate_mbit: float = 0.25
    """Bandwidth of the site's link, each way."""
    rtt_ms: float = 40.0
    budget: float = 1.0
    """--sync-budget of the auto configuration (seconds a push and a pull may take)."""
    batch_size: int = 4
    max_seq_len: int = 64
    lora_rank: int = 32
    """Rank 32 on tiny-qwen2: a 600 kB fp32 update, so tbf's 64 KiB burst (needed for GSO) is a small part."""
    lr: float | None = None
    """None: the preset's recommended rate (models.presets.RECOMMENDED_LR)."""
    seed: int = 0
    """Run seed: worker i trains with seed ``seed * workers + i`` (its LoRA init and data order) and, from
    seed 1 on, gets a worker id with the seed in it, so the random-k selections differ too. Seed 0 is
    the single-seed run of before --seeds (worker ids adaptive-0, adaptive-1; training seeds 0, 1)."""


@dataclass(frozen=True)
class Config:
    name: str
    codec: str
    config: dict
    budget: float | None = None
    error_feedback: bool = True


# -- the driver inside the site ----------------------------------------------------------------


def drive(spec_path: Path) -> None:
    """Run one configuration's federated job against spec["url"]; write every sync record to spec["out"]."""
    import torch

    from protocol.client import CoordinatorClient
    from worker.data import load_examples, split_examples
    from worker.encoding import CompressionSettings, PullSettings, UpdateEncoder
    from worker.federation import FederatedWorker, SyncSettings
    from models.loading import load_base_model
    from models.presets import RECOMMENDED_LR
    from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

    spec = json.loads(spec_path.read_text())
    s, c = Settings(**spec["settings"]), Config(**spec["config"])
    torch.set_num_threads(1)
    train, _ = split_examples(load_examples(sample_path(SPECIALTY)))
    team = []
    for i in range(s.workers):
        base = load_base_model(s.base_model)
        lr = s.lr or RECOMMENDED_LR.get(s.base_model, 2e-4)
        trainer = LoraTrainer(base, LoraSettings(rank=s.lora_rank),
                              TrainSettings(lr=lr, batch_size=s.batch_size, max_seq_len=s.max_seq_len,
                                            seed=s.seed * s.workers + i), train)
        spec_json = {"lora": trainer.lora_config, "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
        worker_id = f"adaptive-{i}" + (f"-s{s.seed}" if s.seed else "")
        config = c.config
        if c.codec == LOSSY.codec:  # its own selection seed per worker, as auto gives each
            config = LOSSY.choice(c.config["ratio"], seed=zlib.crc32(worker_id.encode())).config
        encoder = UpdateEncoder(CompressionSettings(c.codec, config, error_feedback=c.error_feedback,
                                                    sync_budget=c.budget))
        worker = FederatedWorker(SyncSettings(specialty=SPECIALTY, worker_id=worker_id),
                                 CoordinatorClient(spec["url"]), trainer, spec_json, encoder=encoder,
                                 pull=PullSettings(codec=None))  # full pulls, or auto's pick: as measured
        worker.joining.join()
        team.append(worker)
    records = []
    for _ in range(s.rounds):
        for worker in team:
            worker.interval.add(worker.trainer.train_steps(s.steps))
            records.append(worker.sync())
    Path(spec["out"]).write_text(json.dumps(records))


# -- one configuration over the link ----------------------------------------------------------


def run_config(c: Config, s: Settings, scratch: Path) -> dict[str, Any]:
    spec_path, out = scratch / f"{c.name}.spec.json", scratch / f"{c.name}.records.json"
    with running_coordinator() as url:
        port = int(url.rsplit(":", 1)[1])
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "HF_HUB_OFFLINE": "1", TOKEN_ENV: recorded_token(url)}  # the site cannot see this host's token file by URL
        with WanLink(("127.0.0.1", port), s.rate_mbit, s.rtt_ms) as link:
            spec_path.write_text(json.dumps({"url": link.url, "out": str(out), "settings": asdict(s),
                                             "config": asdict(c)}))
            started = time.monotonic()
            proc = link.site.popen([sys.executable, "-m", "bench.adaptive", "--drive", str(spec_path)], cwd=ROOT,
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                _, errors = proc.communicate(timeout=1800)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            wall = time.monotonic() - started
            ingress, egress = link.proxy.bytes_to_target, link.proxy.bytes_to_client
        if proc.returncode != 0:
            raise RuntimeError(f"{c.name}: the driver exited {proc.returncode}:\n{errors[-3000:]}")
        losses, tensors = expert_loss(url, s)
    records = json.loads(out.read_text())
    return {"name": c.name, "seed": s.seed, "codec": c.codec, "config": c.config, "budget": c.budget,
            **figures(records, s.budget), "heldout_loss": round(losses["loss"], 4),
            "heldout_loss_without_end": round(losses["loss_without_end"], 4), "tensors": tensors,
            "link_bytes_up": ingress, "link_bytes_down": egress, "wall_seconds": round(wall, 1),
            "syncs": [{k: r.get(k) for k in ("worker_id", "codec", "codec_config", "bytes_sent", "push_seconds",
                                             "pull_codec", "bytes_down", "pull_seconds")} for r in records]}


def expert_loss(url: str, s: Settings) -> tuple[dict[str, float], int]:
    """Held-out loss of the expert as the coordinator holds it ({"loss", "loss_without_end"}: per answer
    token, with and without the end-of-answer token), and its number of tensors."""
    from bench.realdata import loss_pair
    from gateway.export import attach_adapter
    from protocol.client import CoordinatorClient
    from worker.data import load_examples, split_examples
    from worker.evaluation import answer_losses
    from models.loading import load_base_model

    client = CoordinatorClient(url)
    _, heldout = split_examples(load_examples(sample_path(SPECIALTY)))
    weights = client.experts.pull(SPECIALTY).tensors
    if weights is None:
        raise RuntimeError("the coordinator returned no weights for the expert")
    base = load_base_model(s.base_model)
    model = attach_adapter(base.model, weights, client.experts.get(SPECIALTY)["lora"])
    model.eval()
    losses = loss_pair(answer_losses(model, base.tokenizer, heldout, max_seq_len=s.max_seq_len))
    client.close()
    return losses, len(weights)


def figures(records: list[dict[str, Any]], budget: float) -> dict[str, Any]:
    pushes = [r for r in records if r.get("bytes_sent")]
    push_s = [r["push_seconds"] for r in pushes]
    pull_s = [r["pull_seconds"] for r in records if r.get("pulled")]
    codecs = Counter(r["codec"] for r in pushes)
    return {"pushes": len(pushes), "numel": pushes[0]["numel"] if pushes else 0,
            "bytes_up": sum(r["bytes_sent"] for r in pushes), "bytes_down": sum(r["bytes_down"] for r in records),
            "mean_push_bytes": round(statistics.fmean(r["bytes_sent"] for r in pushes)) if pushes else 0,
            "push_seconds_median": round(statistics.median(push_s), 3) if push_s else None,
            "pushes_within_budget": round(sum(t <= budget for t in push_s) / len(push_s), 3) if push_s else None,
            "pull_seconds_median": round(statistics.median(pull_s), 3) if pull_s else None,
            "pulls_within_budget": round(sum(t <= budget for t in pull_s) / len(pull_s), 3) if pull_s else None,
            "codecs": dict(codecs), "pull_codecs": dict(Counter(r.get("pull_codec", "full") for r in records
                                                               if r.get("pulled"))),
            "mean_relative_error": round(statistics.fmean(r["relative_error"] for r in pushes), 4) if pushes else None}


def same_bytes_ratio(auto: dict[str, Any], records: list[dict[str, Any]], rung: SparseRung) -> float:
    """The ratio of ``rung``'s codec whose pushes are as large, on average, as auto's were.

    The size model is calibrated on auto's own random-k pushes (actual / expected bytes), so the
    fixed codec matches the bytes auto really sent, not what the model expected.
    """
    own = [r for r in records if r.get("codec") == LOSSY.codec and r.get("bytes_sent")]
    scale = (statistics.fmean(r["bytes_sent"] for r in own) / statistics.fmean(
        LOSSY.size(ratio_of(r["codec_config"]) or 0.0, auto["numel"], auto["tensors"]) for r in own)) if own else 1.0
    return round(rung.ratio_for(auto["mean_push_bytes"] / scale, auto["numel"], auto["tensors"]), 5)


# -- summary over seeds -----------------------------------------------------------------------


def fixed_configs(ratios: dict[str, float]) -> list[Config]:
    """The fixed codecs auto is compared with; the sparse ones at the ratios of auto's mean push size."""
    return [Config(f"{LOSSY.codec} same bytes", LOSSY.codec, {"ratio": ratios[LOSSY.codec], **dict(LOSSY.options)},
                   error_feedback=False),
            Config(f"{TOPK_INT8.codec} same bytes", TOPK_INT8.codec, {"ratio": ratios[TOPK_INT8.codec]}),
            Config("int4", "int4", {}), Config("int8", "int8", {}), Config("safetensors", "safetensors", {})]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration over seeds: bytes a push against auto's and fp32's, pushes within the budget, held-out
    loss (with and without the end token) and its paired difference to auto's on the same seed; then the
    verdict against the best fixed codec no larger than ``SAME_SIZE`` x auto's mean push."""
    from bench.realdata import spread

    names = list(dict.fromkeys(r["name"] for r in rows))
    by = {n: {r["seed"]: r for r in rows if r["name"] == n} for n in names}
    auto = by["auto"]
    numel = next(iter(auto.values()))["numel"]
    fp32 = (statistics.fmean(r["mean_push_bytes"] for r in by["safetensors"].values()) if "safetensors" in by
            else RAW_BYTES * numel)
    auto_bytes = statistics.fmean(r["mean_push_bytes"] for r in auto.values())
    table: dict[str, Any] = {}
    for name in names:
        seeds = by[name]
        push_bytes = statistics.fmean(r["mean_push_bytes"] for r in seeds.values())
        pushes = sum(r["pushes"] for r in seeds.values())
        within = sum(round((r["pushes_within_budget"] or 0) * r["pushes"]) for r in seeds.values())
        paired = [auto[k]["heldout_loss"] - r["heldout_loss"] for k, r in seeds.items() if k in auto]
        paired_ne = [auto[k]["heldout_loss_without_end"] - r["heldout_loss_without_end"]
                     for k, r in seeds.items() if k in auto]
        table[name] = {"codec": next(iter(seeds.values()))["codec"], "seeds": sorted(seeds),
                       "mean_push_bytes": round(push_bytes), "bytes_per_param": round(push_bytes / numel, 4),
                       "bytes_vs_auto": round(push_bytes / auto_bytes, 3), "ratio_vs_fp32": round(fp32 / push_bytes, 2),
                       "pushes": pushes, "pushes_within_budget": within,
                       "heldout_loss": spread([r["heldout_loss"] for r in seeds.values()]),
                       "heldout_loss_without_end": spread([r["heldout_loss_without_end"] for r in seeds.values()]),
                       "auto_minus_this": spread(paired) if name != "auto" else None,
                       "auto_minus_this_without_end": spread(paired_ne) if name != "auto" else None,
                       "same_size_or_smaller": name != "auto" and push_bytes <= SAME_SIZE * auto_bytes}
    rivals = [n for n, v in table.items() if v["same_size_or_smaller"]]
    best = min(rivals, key=lambda n: table[n]["heldout_loss"]["mean"]) if rivals else None
    verdict: dict[str, Any] = {"rivals": rivals, "best": best}
    if best is not None:
        diff = table[best]["auto_minus_this"]
        verdict.update({
            "auto_mean": table["auto"]["heldout_loss"]["mean"], "best_mean": table[best]["heldout_loss"]["mean"],
            "auto_minus_best": diff,
            "not_worse": table["auto"]["heldout_loss"]["mean"] <= table[best]["heldout_loss"]["mean"],
            "not_worse_without_end": (table["auto"]["heldout_loss_without_end"]["mean"]
                                      <= table[best]["heldout_loss_without_end"]["mean"]),
            # worse beyond noise: the paired difference's mean is over twice its standard error
            "worse_beyond_noise": bool(diff["n"] > 1 and diff["mean"] > 2 * diff["std"] / math.sqrt(diff["n"]))})
    return {"configurations": table, "verdict": verdict}


def paired(d: dict[str, Any] | None) -> str:
    """'+0.0012 +/- 0.0008' of a paired-difference spread ('' for none)."""
    return f"{d['mean']:+.4f} +/- {d['std']:.4f}" if d and d["n"] else ""


def print_report(report: dict[str, Any]) -> None:
    from bench.realdata import pm

    s, table, verdict = report["settings"], report["summary"]["configurations"], report["summary"]["verdict"]
    print(format_table(
        ["configuration", "push bytes (mean)", "B/param", "vs auto bytes", "fp32 / this", "pushes <= budget",
         "held-out loss (seeds)", "w/o end token", "auto - this (paired)", "codecs (all seeds)"],
        [[name, v["mean_push_bytes"], v["bytes_per_param"], v["bytes_vs_auto"], v["ratio_vs_fp32"],
          f"{v['pushes_within_budget']}/{v['pushes']}", pm(v["heldout_loss"]), pm(v["heldout_loss_without_end"]),
          paired(v["auto_minus_this"]),
          " ".join(f"{k}:{n}" for k, n in sum((Counter(r["codecs"]) for r in report["records"]
                                               if r["name"] == name), Counter()).items())]
         for name, v in table.items()]))
    line = (f"\nbudget {s['budget']} s over {s['rate_mbit']} Mbit/s, {s['rtt_ms']} ms RTT; {s['workers']} workers x "
            f"{s['rounds']} rounds x {s['steps']} steps; seeds {report['seeds']}; same-bytes ratios "
            f"{report['same_bytes_ratio']}; ")
    if verdict["best"] is not None:
        line += (f"auto {verdict['auto_mean']:.4f} vs best fixed codec no larger than {SAME_SIZE}x auto's push "
                 f"({verdict['best']}) {verdict['best_mean']:.4f}: "
                 f"{'not worse' if verdict['not_worse'] else 'WORSE'}"
                 f"{' (beyond noise)' if verdict['worse_beyond_noise'] else ''}; ")
    print(line + f"{report['cpu_seconds']} CPU s; results in {report['out']}")


# -- main -------------------------------------------------------------------------------------


def load_fixed(path: Path, s: Settings, seeds: int) -> tuple[list[dict[str, Any]], dict[str, float]] | str:
    """The fixed rows and same-bytes ratios of an earlier run, or why they cannot be used."""
    try:
        earlier = json.loads(path.read_text())
        settings, records, ratios = earlier["settings"], earlier["records"], earlier["same_bytes_ratio"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"cannot read --fixed-from {path}: {exc}"
    ours = {k: v for k, v in asdict(s).items() if k != "seed"}
    theirs = {k: v for k, v in settings.items() if k != "seed"} if isinstance(settings, dict) else settings
    if theirs != ours:
        return f"--fixed-from {path} was run with other settings ({theirs}, here {ours})"
    rows = [r for r in records if isinstance(r, dict)]
    missing = sorted({(c.name, k) for c in fixed_configs(ratios) + [Config("auto", "auto", {})] for k in range(seeds)}
                     - {(r.get("name"), r.get("seed", 0)) for r in rows})
    if missing:
        return f"--fixed-from {path} lacks {len(missing)} (configuration, seed) rows, e.g. {missing[0]}"
    return [r for r in rows if r.get("seed", 0) < seeds], ratios


@dataclass(frozen=True)
class Options:
    """The command line: one job's settings, and which configurations and seeds run."""

    base_model: str = option(Settings.base_model, "tiny-qwen2 or smollm2-135m")
    workers: int = option(Settings.workers, "in-process workers of the one expert")
    rounds: int = option(Settings.rounds, "syncs per worker")
    steps: int = option(Settings.steps, "training steps per worker between syncs")
    rate_mbit: float = option(Settings.rate_mbit, "link bandwidth each way")
    rtt_ms: float = option(Settings.rtt_ms, "round-trip time of the link")
    budget: float = option(Settings.budget, "--sync-budget of auto, seconds")
    lora_rank: int = option(Settings.lora_rank, "LoRA rank")
    seeds: int = option(1, "run seeds 0..N-1 of every configuration (LoRA init, data order, random-k selections); "
                        "table shows mean +/- std")
    fixed_from: Path | None = option(None, "run auto only and take the fixed codecs' rows (and same-bytes ratios) "
                                     "from this earlier results file of the same settings and seeds: they do not "
                                     "depend on auto's ladder", type=Path, metavar="RESULTS_JSON")
    topk_ratios: tuple[float, ...] = option((), "also run top-k + int8 (error feedback) at each of these fixed "
                                            "ratios, every seed", nargs="+", type=float, metavar="RATIO")
    extra_only: bool = option(False, "with --fixed-from: take auto's rows from that file too and run only the "
                              "--topk-ratios ones")
    drive: Path | None = option(None, "the driver inside the site: run the job this spec file describes",
                                type=Path, hidden=True)

    def __post_init__(self) -> None:
        for name in ("workers", "rounds", "steps", "lora_rank", "seeds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("rate_mbit", "rtt_ms", "budget"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.extra_only and self.fixed_from is None:
            raise ValueError("--extra-only needs --fixed-from (the run whose rows it keeps)")
        if self.extra_only and not self.topk_ratios:
            raise ValueError("--extra-only runs only the --topk-ratios configurations; give at least one")
        bad = [r for r in self.topk_ratios if not TOPK_INT8.min_ratio <= r <= 1]
        if bad:
            raise ValueError(f"--topk-ratios must be within [{TOPK_INT8.min_ratio}, 1], got {bad[0]}")

    def job(self) -> Settings:
        return Settings(base_model=self.base_model, workers=self.workers, rounds=self.rounds, steps=self.steps,
                        rate_mbit=self.rate_mbit, rtt_ms=self.rtt_ms, budget=self.budget, lora_rank=self.lora_rank)


def run(o: Options, ctx: Run) -> int:
    if o.drive is not None:
        drive(o.drive)
        return 0
    s = o.job()
    fixed: list[dict[str, Any]] = []
    ratios: dict[str, float] | None = None
    if o.fixed_from is not None:
        loaded = load_fixed(o.fixed_from, s, o.seeds)
        if isinstance(loaded, str):
            print(f"error: {loaded}", file=sys.stderr)
            return 2
        fixed, ratios = loaded
        if not o.extra_only:
            fixed = [r for r in fixed if r["name"] != "auto"]
    try:
        check_available()
    except NamespaceUnavailable as exc:
        print(f"error: bench.adaptive needs network namespaces to throttle the link: {exc}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fedmoe-adaptive-", dir=SCRATCH_DIR) as scratch:
        for seed in range(o.seeds):
            ss = dataclasses.replace(s, seed=seed)
            extras = [Config(f"topk+int8 ratio {r:g}", TOPK_INT8.codec, {"ratio": r}) for r in o.topk_ratios]
            if o.extra_only:
                rows += [r for r in fixed if r.get("seed", 0) == seed]
                for c in extras:
                    log.info("seed %d: %s", seed, c.name)
                    rows.append(run_config(c, ss, Path(scratch)))
                continue
            log.info("seed %d: auto (--sync-budget %.3g s) over %.3g Mbit/s, %.0f ms RTT", seed, s.budget,
                     s.rate_mbit, s.rtt_ms)
            auto = run_config(Config("auto", "auto", {}, s.budget), ss, Path(scratch))
            rows.append(auto)
            if ratios is None:  # the same fixed codecs on every seed: sized from seed 0's auto
                auto_records = json.loads((Path(scratch) / "auto.records.json").read_text())
                ratios = {rung.codec: same_bytes_ratio(auto, auto_records, rung) for rung in (LOSSY, TOPK_INT8)}
            if o.fixed_from is not None:
                rows += [r for r in fixed if r.get("seed", 0) == seed]
            for c in ([] if o.fixed_from is not None else fixed_configs(ratios)) + extras:
                log.info("seed %d: %s", seed, c.name)
                rows.append(run_config(c, ss, Path(scratch)))
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    report = {"benchmark": "adaptive", "settings": asdict(s), "seeds": o.seeds, "same_bytes_ratio": ratios,
              "fixed_from": str(o.fixed_from) if o.fixed_from else None, "records": rows,
              "summary": summarize(rows), "seconds": ctx.seconds(),
              "cpu_seconds": round(own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime, 1),
              "out": str(ctx.out)}
    ctx.write(report)
    print_report(report)
    return 0


BENCH = Bench("adaptive", tags=("network",), settings=Options, run=run)  # the defaults are a run of minutes
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
