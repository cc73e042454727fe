#!/usr/bin/env python3
"""Several workers on one expert: does the expert's held-out loss fall as Flower's FedAvg's does, at equal steps?

One DS-1000 library's train/ split N ways (worker i gets problems i, i+N, ...); N real ``run_worker.py``
processes train one expert against a real coordinator (in this process, on loopback), each for
``--steps`` optimiser steps (``--max-steps``), pushing every ``--sync-interval`` seconds. Every arm gets the
same model, LoRA, lr, batch, sequence length and data order; what differs is how updates are combined:

- ``default``: the coordinator's defaults (fedasync, alpha = 1 / N and staleness grace N - 1 for the N workers on
  the expert);
- ``original``: ``--async-alpha 1``, the original tool's rule (each update at full weight as it arrives);
- ``fedbuff``: ``--aggregation fedbuff --buffer-size N``;
- ``flower``: Flower's FedAvg (bench/flower_baseline.py, its own virtualenv, requirements-bench.txt) on the same
  shards with the same trainer, ``--steps / --local-steps`` rounds of ``--local-steps`` steps per client.

Every stored version (FedMoE) or round (Flower) is scored on the library's heldout/ problems (answer-token loss,
never trained on) and placed at the optimiser steps all workers had taken when it was made (its samples /
batch). The table says, per arm: the base model's loss, the highest and the final loss, whether any version
rose above the base, and the final loss against FedAvg's at the same total steps.

    python -m bench.converge                                  # smollm2-135m, 3 and 6 workers (needs make smollm2)
    python -m bench.converge --quick                          # tiny-qwen2, 2 workers, a smoke run
    python -m bench.converge --workers 3 --arms original default flower

Memory: a smollm2 worker at batch 4 x 96 tokens peaks near 2 GB, so 6 run at once; Flower's simulation trains its
clients one at a time in one Ray actor. Steps, not seconds, are the x axis: machine load changes the wall
time of a run, not its curve (bar the order in which asynchronous updates arrive).
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import ROOT, SCRATCH_DIR, format_table, running_coordinator
from bench.harness import Bench, Run
from bench.realdata import REAL_MODEL, SMOKE_MODEL, Lab, loss_pair
from protocol.cli import option
from protocol.client import CoordinatorClient
from worker.data import Example, load_examples

log = logging.getLogger("bench.converge")

FLOWER_PYTHON = ROOT / ".venv-flower" / "bin" / "python"
COORDINATOR_ARMS: dict[str, dict[str, Any]] = {
    "default": {},
    "original": {"async_alpha": 1.0},
    "fedbuff": {"aggregation": "fedbuff"},  # buffer_size = the number of workers, set per run
}
ARMS = (*COORDINATOR_ARMS, "flower")


@dataclass(frozen=True)
class Plan:
    """What every arm of a run shares."""

    base_model: str
    domain: str
    steps: int
    """Optimiser steps per worker (--max-steps; Flower: rounds x local steps)."""
    local_steps: int
    """Flower: steps per client per round."""
    lr: float
    batch_size: int
    max_seq_len: int
    sync_interval: float
    max_evals: int
    """Versions scored per FedMoE arm at most, evenly spread, first and last always."""
    worker_flags: tuple[str, ...] = ()
    """More run_worker.py flags for every FedMoE worker (e.g. lossless codecs, to see what compression costs)."""


@dataclass
class Curve:
    arm: str
    workers: int
    points: list[dict[str, Any]]
    """{"steps": all workers' optimiser steps so far, "version" or "round", "loss", "loss_without_end"}."""
    wall_seconds: float
    versions: int = 0
    steps_log: list[dict[str, Any]] | None = None
    """FedMoE: each version's step as the coordinator's audit log has it (seconds since the first version, update
    ids, staleness, alpha, staleness grace, workers counted and alive), to see why a version rose."""

    def summary(self, base: float, reference: float | None) -> dict[str, Any]:
        losses = [p["loss"] for p in self.points]
        final = losses[-1]
        return {"arm": self.arm, "workers": self.workers, "base": base, "highest": max(losses), "final": final,
                "final_steps": self.points[-1]["steps"], "rose_above_base": max(losses) > base,
                "final_vs_fedavg": None if reference is None else final - reference,
                "versions": self.versions, "scored": len(self.points), "wall_seconds": round(self.wall_seconds, 1)}


def write_shards(domain: str, n: int, directory: Path) -> list[Path]:
    """``shard-<i>.jsonl``: problem i, i+n, ... of the library's train/ file (the rows as shipped)."""
    rows = (ROOT / "data" / "ds1000" / "train" / f"{domain}.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [r for r in rows if r.strip()]
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = directory / f"shard-{i}.jsonl"
        path.write_text("\n".join(rows[i::n]) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def worker_command(plan: Plan, url: str, shard: Path, index: int, work: Path) -> list[str]:
    return [sys.executable, str(ROOT / "run_worker.py"), "--coordinator-url", url, "--specialty", plan.domain,
            "--worker-id", f"w{index}", "--dataset", str(shard), "--base-model", plan.base_model,
            "--max-steps", str(plan.steps), "--duration", "86400", "--sync-interval", str(plan.sync_interval),
            "--lr", str(plan.lr), "--batch-size", str(plan.batch_size), "--max-seq-len", str(plan.max_seq_len),
            "--seed", "0", "--threads", "1", "--no-heldout-eval", "--state-dir", str(work / f"state-{index}"),
            "--results", str(work / f"results-{index}.jsonl"), "--log-format", "json", *plan.worker_flags]


def run_fedmoe(lab: Lab, plan: Plan, arm: str, shards: list[Path], heldout: list[Example], work: Path) -> Curve:
    """N worker processes against a coordinator with the arm's settings; its versions scored."""
    settings = dict(COORDINATOR_ARMS[arm], keep_versions=100_000, gateway_interval=3600.0)
    if arm == "fedbuff":
        settings["buffer_size"] = len(shards)
    started = time.monotonic()
    with running_coordinator(**settings) as url:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
        procs = []
        for i, shard in enumerate(shards):
            logfile = open(work / f"{arm}-worker-{i}.log", "w")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen(worker_command(plan, url, shard, i, work / arm), cwd=ROOT, env=env,
                                           stdout=logfile, stderr=subprocess.STDOUT), logfile))
        for i, (proc, logfile) in enumerate(procs):
            code = proc.wait()
            logfile.close()
            if code != 0:
                tail = (work / f"{arm}-worker-{i}.log").read_text()[-2000:]
                raise RuntimeError(f"{arm}: worker {i} exited with {code}:\n{tail}")
        wall = time.monotonic() - started
        client = CoordinatorClient(url)
        versions = client.experts.get(plan.domain)["versions"]
        lora = client.experts.get(plan.domain)["lora"]
        steps_log = version_steps(client, plan.domain)
        points = []
        for entry in scored_versions(versions, plan.max_evals, plan.batch_size):
            adapter = client.experts.pull(plan.domain, version=entry["version"]).tensors
            points.append({"version": entry["version"], "steps": entry["steps"],
                           **loss_pair(lab.losses(heldout, adapter, lora))})
            log.info("%s x%d: version %d (%d steps) held-out %.4f", arm, len(shards), entry["version"],
                     entry["steps"], points[-1]["loss"])
    return Curve(arm, len(shards), points, wall, versions=len(versions) - 1, steps_log=steps_log)


def version_steps(client: CoordinatorClient, expert: str) -> list[dict[str, Any]]:
    """The expert's version_applied events, oldest first (the newest 500), each reduced to what weighed its updates."""
    events = sorted((e for e in client.events("version_applied", limit=500) if e["expert"] == expert),
                    key=lambda e: e["detail"]["version"])
    t0 = events[0]["time"] if events else 0.0
    keys = ("version", "update_ids", "staleness", "alpha", "staleness_grace", "workers_counted", "workers_alive")
    return [{"seconds": round(e["time"] - t0, 1), **{k: e["detail"][k] for k in keys if k in e["detail"]}}
            for e in events]


def scored_versions(versions: list[dict[str, Any]], limit: int, batch_size: int) -> list[dict[str, Any]]:
    """The versions to score (each with ``steps``: all workers' optimiser steps so far), evenly spread."""
    samples, out = 0, []
    for entry in versions:
        samples += entry.get("samples") or 0
        out.append({"version": entry["version"], "steps": samples // batch_size})
    if len(out) > limit:
        picks = sorted({round(i * (len(out) - 1) / (limit - 1)) for i in range(limit)})
        out = [out[i] for i in picks]
    return out


def run_flower(lab: Lab, plan: Plan, shards: list[Path], heldout: list[Example], work: Path,
               flower_python: Path, parallel: int = 1) -> Curve:
    """Flower's FedAvg (simulation engine) in its own virtualenv, on the same shards; every round scored."""
    out = work / "flower"
    rounds = plan.steps // plan.local_steps
    command = [str(flower_python), "-m", "bench.flower_baseline", "--shards", str(shards[0].parent), "--out", str(out),
               "--clients", str(len(shards)), "--rounds", str(rounds), "--local-steps", str(plan.local_steps),
               "--base-model", plan.base_model, "--lr", str(plan.lr), "--batch-size", str(plan.batch_size),
               "--max-seq-len", str(plan.max_seq_len), "--seed", "0", "--threads", "1", "--parallel", str(parallel)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT), "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
    started = time.monotonic()
    with open(work / "flower.log", "w") as logfile:
        code = subprocess.run(command, cwd=ROOT, env=env, stdout=logfile, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - started
    index = json.loads((out / "rounds.json").read_text()) if (out / "rounds.json").is_file() else []
    if code != 0 or len(index) != rounds + 1 or any(r["replies"] != len(shards) for r in index):
        raise RuntimeError(f"Flower's run failed (exit {code}, rounds {[r.get('replies') for r in index]}); "
                           f"see {work / 'flower.log'}")
    from safetensors.torch import load_file

    points = []
    for entry in index:
        adapter = load_file(str(out / entry["file"]))
        steps = entry["steps_per_client"] * len(shards)
        points.append({"round": entry["round"], "steps": steps,
                       **loss_pair(lab.losses(heldout, adapter, lab_lora(adapter)))})
        log.info("flower x%d: round %d (%d steps) held-out %.4f", len(shards), entry["round"], steps,
                 points[-1]["loss"])
    return Curve("flower", len(shards), points, wall, versions=rounds)


def lab_lora(adapter: dict[str, Any]) -> dict[str, Any]:
    """The LoRA config of a worker's adapter (rank 8, alpha 16, every projection it has), as the expert's spec."""
    modules = sorted({key.split(".")[-3] for key in adapter if key.endswith("lora_A.weight")})
    rank = next(t.shape[0] for k, t in adapter.items() if k.endswith("lora_A.weight"))
    return {"rank": rank, "alpha": 2.0 * rank, "target_modules": modules}


def check_flower(python: Path) -> str | None:
    """Why Flower cannot run (a line to print), or None."""
    if not python.is_file():
        return (f"{python} is missing: Flower lives in its own virtualenv (python -m venv .venv-flower && "
                ".venv-flower/bin/pip install -r requirements.txt -r requirements-bench.txt), or pass --flower-python")
    probe = subprocess.run([str(python), "-c", "import flwr, ray"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"{python} cannot import flwr and ray: {probe.stderr.strip()[-300:]}"


def render(rows: list[dict[str, Any]]) -> str:
    headers = ["workers", "arm", "versions", "base", "highest", "final", "steps", "above base", "final - FedAvg"]
    return format_table(headers, [[r["workers"], r["arm"], r["versions"], round(r["base"], 4), round(r["highest"], 4),
                                   round(r["final"], 4), r["final_steps"], "yes" if r["rose_above_base"] else "no",
                                   None if r["final_vs_fedavg"] is None else round(r["final_vs_fedavg"], 4)]
                                  for r in rows])


@dataclass(frozen=True)
class Settings:
    workers: tuple[int, ...] = option((3, 6), "workers per expert, one run each", nargs="+", type=int)
    arms: tuple[str, ...] = option(("original", "default", "flower"), "arms compared", nargs="+", choices=ARMS)
    base_model: str = option(REAL_MODEL, "the workers' model")
    domain: str = option("numpy_expert", "DS-1000 library (data/ds1000/{train,heldout}/)")
    steps: int = option(8, "optimiser steps per worker")
    local_steps: int = option(2, "Flower: steps per client per round")
    lr: float = option(1e-3, "AdamW learning rate")
    batch_size: int = option(4, "examples per step")
    max_seq_len: int = option(96, "tokens per example")
    sync_interval: float = option(30.0, "FedMoE workers' seconds between pushes")
    max_evals: int = option(6, "versions scored per FedMoE arm at most")
    flower_python: Path = option(FLOWER_PYTHON, "the interpreter of Flower's own virtualenv", type=Path)
    flower_parallel: int = option(1, "Flower clients trained at once (each a model copy in memory; FedAvg's result is "
                                  "the same)")
    worker_flags: str = option("", "more run_worker.py flags for every FedMoE worker, one string (e.g. "
                               "'--compression safetensors --pull-compression full': lossless both ways)")

    def __post_init__(self) -> None:
        if self.steps % self.local_steps:
            raise ValueError(f"--steps {self.steps} must be a multiple of --local-steps {self.local_steps} "
                             "(Flower's rounds)")
        if min(self.workers) < 1 or self.max_evals < 2:
            raise ValueError("--workers must be >= 1 and --max-evals >= 2")

    def plan(self) -> Plan:
        return Plan(self.base_model, self.domain, self.steps, self.local_steps, self.lr, self.batch_size,
                    self.max_seq_len, self.sync_interval, self.max_evals, tuple(shlex.split(self.worker_flags)))


def run(s: Settings, ctx: Run) -> int:
    if "flower" in s.arms and (problem := check_flower(s.flower_python)):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    plan = s.plan()
    lab = Lab(plan.base_model, batch_size=plan.batch_size, max_seq_len=plan.max_seq_len)
    heldout = load_examples(ROOT / "data" / "ds1000" / "heldout" / f"{plan.domain}.jsonl")
    base = loss_pair(lab.losses(heldout))["loss"]
    log.info("base model: held-out %.4f on %d %s problems", base, len(heldout), plan.domain)
    curves: list[Curve] = []
    failures: list[str] = []
    for n in s.workers:
        with tempfile.TemporaryDirectory(prefix=f"converge-{n}-", dir=SCRATCH_DIR) as tmp:
            work = Path(tmp)
            shards = write_shards(plan.domain, n, work / "shards")
            for arm in s.arms:
                (work / arm).mkdir()
                try:
                    curves.append(run_flower(lab, plan, shards, heldout, work, s.flower_python, s.flower_parallel)
                                  if arm == "flower" else run_fedmoe(lab, plan, arm, shards, heldout, work))
                except RuntimeError as exc:  # one arm failing keeps the others' curves (and says why)
                    log.error("%s x%d failed: %s", arm, n, exc)
                    failures.append(f"{arm} x{n}: {str(exc)[:300]}")
                    keep_log(work, arm, n, ctx.out)
                write_result(ctx, plan, base, curves, failures, lab)  # after every arm
    rows = summaries(curves, base)
    print(f"\n{plan.domain} held-out answer-token loss ({len(heldout)} problems), {plan.base_model}, "
          f"{plan.steps} steps per worker, batch {plan.batch_size} x {plan.max_seq_len}, lr {plan.lr:g}\n")
    print(render(rows))
    print(f"\nwrote {ctx.out}" + (f"; failed: {'; '.join(failures)}" if failures else ""))
    return 1 if failures else 0


def summaries(curves: list[Curve], base: float) -> list[dict[str, Any]]:
    rows = []
    for curve in curves:
        reference = next((c.points[-1]["loss"] for c in curves if c.arm == "flower" and c.workers == curve.workers),
                         None)
        rows.append(curve.summary(base, reference))
    return rows


def write_result(ctx: Run, plan: Plan, base: float, curves: list[Curve], failures: list[str], lab: Lab) -> None:
    ctx.write({"plan": asdict(plan), "base_loss": base, "summary": summaries(curves, base),
               "curves": [asdict(c) for c in curves], "failures": failures, "wall_seconds": ctx.seconds(),
               "cost": lab.compute.as_dict()})


def keep_log(work: Path, arm: str, n: int, out: Path) -> None:
    """A failed arm's logs, kept in the temp dir (the run's own directory is removed at the end)."""
    kept = Path(tempfile.gettempdir()) / f"{out.stem}-{arm}-x{n}-logs"
    kept.mkdir(parents=True, exist_ok=True)
    for path in work.glob("*.log"):
        if path.name.startswith((arm, "flower")):
            (kept / path.name).write_bytes(path.read_bytes()[-200_000:])


BENCH = Bench("converge", tags=("learning",), settings=Settings, run=run, cores=1,
              quick={"base_model": SMOKE_MODEL, "workers": (2,), "steps": 4, "lr": 1e-2, "max_seq_len": 64,
                     "sync_interval": 2.0})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
