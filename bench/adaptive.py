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

    python -m bench.adaptive --quick                  # tiny-qwen2, 2 workers x 4 rounds, ~15 min on a loaded 2-core machine
    python -m bench.adaptive --base-model smollm2-135m --rate-mbit 20 --budget 2

Needs root (network namespaces). Table on stdout, progress on stderr, results in
bench/results/adaptive.json.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
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

from bench.common import RESULTS_DIR, SCRATCH_DIR, configure_logging, format_table, running_coordinator, write_json_atomic
from bench.wanemu import NamespaceUnavailable, WanLink, check_available
from protocol.credentials import TOKEN_ENV, local_token
from worker.adaptive import LOSSY, TOPK_INT8, SparseRung, ratio_of

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
    """None: the preset's recommended rate (worker.presets.RECOMMENDED_LR)."""


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
    from worker.data import load_examples, sample_dataset_path, split_examples
    from worker.encoding import CompressionSettings, UpdateEncoder
    from worker.federation import FederatedWorker, SyncSettings
    from worker.models import load_base_model
    from worker.presets import RECOMMENDED_LR
    from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

    spec = json.loads(spec_path.read_text())
    s, c = Settings(**spec["settings"]), Config(**spec["config"])
    torch.set_num_threads(1)
    train, _ = split_examples(load_examples(sample_dataset_path(SPECIALTY)))
    team = []
    for i in range(s.workers):
        base = load_base_model(s.base_model)
        lr = s.lr or RECOMMENDED_LR.get(s.base_model, 2e-4)
        trainer = LoraTrainer(base, LoraSettings(rank=s.lora_rank),
                              TrainSettings(lr=lr, batch_size=s.batch_size, max_seq_len=s.max_seq_len, seed=i), train)
        spec_json = {"lora": trainer.lora_config, "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
        worker_id = f"adaptive-{i}"
        config = c.config
        if c.codec == LOSSY.codec:  # its own selection seed per worker, as auto gives each
            config = LOSSY.choice(c.config["ratio"], seed=zlib.crc32(worker_id.encode())).config
        encoder = UpdateEncoder(CompressionSettings(c.codec, config, error_feedback=c.error_feedback,
                                                    sync_budget=c.budget))
        worker = FederatedWorker(SyncSettings(specialty=SPECIALTY, worker_id=worker_id),
                                 CoordinatorClient(spec["url"]), trainer, spec_json, encoder=encoder)
        worker.join()
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
               "HF_HUB_OFFLINE": "1", TOKEN_ENV: local_token(url)}  # the site cannot see this host's token file by URL
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
        loss, tensors = expert_loss(url, s)
    records = json.loads(out.read_text())
    return {"name": c.name, "codec": c.codec, "config": c.config, "budget": c.budget,
            **figures(records, s.budget), "heldout_loss": round(loss, 4), "tensors": tensors,
            "link_bytes_up": ingress, "link_bytes_down": egress, "wall_seconds": round(wall, 1),
            "syncs": [{k: r.get(k) for k in ("worker_id", "codec", "codec_config", "bytes_sent", "push_seconds",
                                             "pull_codec", "bytes_down", "pull_seconds")} for r in records]}


def expert_loss(url: str, s: Settings) -> tuple[float, int]:
    """Held-out loss of the expert as the coordinator holds it, and its number of tensors."""
    from protocol.client import CoordinatorClient
    from worker.data import load_examples, sample_dataset_path, split_examples
    from worker.evaluation import adapter_loss
    from worker.models import load_base_model

    client = CoordinatorClient(url)
    _, heldout = split_examples(load_examples(sample_dataset_path(SPECIALTY)))
    weights = client.pull_weights(SPECIALTY).tensors
    loss = adapter_loss(load_base_model(s.base_model), heldout, weights, client.expert(SPECIALTY)["lora"],
                        max_seq_len=s.max_seq_len)
    client.close()
    return loss, len(weights)


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


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny-qwen2, 2 workers x 4 rounds (the default settings)")
    p.add_argument("--base-model", default=Settings.base_model, help="tiny-qwen2 or smollm2-135m (default: %(default)s)")
    p.add_argument("--workers", type=int, default=Settings.workers)
    p.add_argument("--rounds", type=int, default=Settings.rounds)
    p.add_argument("--steps", type=int, default=Settings.steps, help="training steps per worker between syncs")
    p.add_argument("--rate-mbit", type=float, default=Settings.rate_mbit, help="link bandwidth each way")
    p.add_argument("--rtt-ms", type=float, default=Settings.rtt_ms)
    p.add_argument("--budget", type=float, default=Settings.budget, help="--sync-budget of auto, seconds")
    p.add_argument("--lora-rank", type=int, default=Settings.lora_rank)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "adaptive.json")
    p.add_argument("--drive", type=Path, default=None, help=argparse.SUPPRESS)  # the driver inside the site
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.drive is not None:
        configure_logging(args.verbose)
        drive(args.drive)
        return 0
    configure_logging(args.verbose)
    for name in ("workers", "rounds", "steps", "lora_rank"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    for name in ("rate_mbit", "rtt_ms", "budget"):
        if not getattr(args, name) > 0:
            print(f"error: --{name.replace('_', '-')} must be positive, got {getattr(args, name)}", file=sys.stderr)
            return 2
    try:
        check_available()
    except NamespaceUnavailable as exc:
        print(f"error: bench.adaptive needs network namespaces to throttle the link: {exc}", file=sys.stderr)
        return 2
    s = Settings(base_model=args.base_model, workers=args.workers, rounds=args.rounds, steps=args.steps,
                 rate_mbit=args.rate_mbit, rtt_ms=args.rtt_ms, budget=args.budget, lora_rank=args.lora_rank)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fedmoe-adaptive-", dir=SCRATCH_DIR) as scratch:
        log.info("auto (--sync-budget %.3g s) over %.3g Mbit/s, %.0f ms RTT", s.budget, s.rate_mbit, s.rtt_ms)
        auto = run_config(Config("auto", "auto", {}, s.budget), s, Path(scratch))
        auto_records = json.loads((Path(scratch) / "auto.records.json").read_text())
        ratios = {rung.codec: same_bytes_ratio(auto, auto_records, rung) for rung in (LOSSY, TOPK_INT8)}
        rows = [auto]
        for c in (Config(f"{LOSSY.codec} same bytes", LOSSY.codec, {"ratio": ratios[LOSSY.codec], **dict(LOSSY.options)},
                         error_feedback=False),
                  Config(f"{TOPK_INT8.codec} same bytes", TOPK_INT8.codec, {"ratio": ratios[TOPK_INT8.codec]}),
                  Config("int4", "int4", {}), Config("int8", "int8", {}), Config("safetensors", "safetensors", {})):
            log.info("%s", c.name)
            rows.append(run_config(c, s, Path(scratch)))
    same_bytes = rows[1:3] + [r for r in rows[3:] if r["mean_push_bytes"] and 1 / SAME_SIZE
                              <= r["mean_push_bytes"] / max(1, auto["mean_push_bytes"]) <= SAME_SIZE]
    best = min(same_bytes, key=lambda r: r["heldout_loss"])
    report = {"benchmark": "adaptive", "settings": asdict(s), "same_bytes_ratio": ratios, "records": rows,
              "best_same_bytes": best["name"],
              "auto_vs_same_bytes_loss": {r["name"]: round(auto["heldout_loss"] - r["heldout_loss"], 4)
                                          for r in same_bytes},
              "auto_not_worse_than_best_same_bytes": auto["heldout_loss"] <= best["heldout_loss"],
              "auto_vs_fixed_loss": {r["name"]: round(auto["heldout_loss"] - r["heldout_loss"], 4) for r in rows[1:]},
              "seconds": round(time.monotonic() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, report)
    print(format_table(
        ["configuration", "held-out loss", "pushes", "push bytes (mean)", "push s (median)", "pushes <= budget",
         "pulled bytes", "pull s (median)", "pulls <= budget", "codecs"],
        [[r["name"], r["heldout_loss"], r["pushes"], r["mean_push_bytes"], r["push_seconds_median"],
          r["pushes_within_budget"], r["bytes_down"], r["pull_seconds_median"], r["pulls_within_budget"],
          " ".join(f"{k}:{v}" for k, v in r["codecs"].items())] for r in rows]))
    print(f"\nbudget {s.budget} s over {s.rate_mbit} Mbit/s, {s.rtt_ms} ms RTT; {s.workers} workers x {s.rounds} "
          f"rounds x {s.steps} steps; same-bytes ratios {ratios}; auto {auto['heldout_loss']} vs best "
          f"fixed codec of its size ({best['name']}) {best['heldout_loss']}; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
