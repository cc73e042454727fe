#!/usr/bin/env python3
"""Load benchmark: 100 simulated workers push real-sized compressed updates to one coordinator on loopback.

The coordinator is a separate real process (run_coordinator.py, durable data dir on disk). The load
comes from bench/loadgen.py in a process of its own: simulated workers register for real, then push
pre-encoded bodies (each stamped to be distinct) over raw HTTP/1.1 with their tokens and digests, so
the generator costs little of the two cores. An update is what a Qwen2-0.5B worker with LoRA r=8 on
all seven projections sends: the manifest shapes come from the model's config (no download), the
deltas are random tensors of those shapes, encoded with a real codec from compression/ (int8 by
default, ~4.7 MB per push).

Closed mode (default): each worker pushes ``--rounds`` updates back to back (throughput). Open mode:
``--workers`` workers each push every ``--interval`` s from a random phase until ``--pushes`` were
sent; latency counts from the scheduled moment, so a coordinator that falls behind shows it.

At the end every acknowledged update_id is looked up (lost = acknowledged but unknown) and each
expert's updates_applied + pending_updates and samples_seen are compared with the updates the
server knows (duplicated = counted more than once). Peak RSS is the kernel's high-water mark
(VmHWM in /proc) of the coordinator's processes.

    python -m bench.load                  # 100 workers x 2 pushes of Qwen2-0.5B LoRA r=8, int8, ~1-2 min
    python -m bench.load --quick          # 8 workers, tiny-qwen2 shapes, K=2, ~10 s (the smoke test)
    python -m bench.load --codec topk+int8 --rounds 5
    python -m bench.load --mode open --workers 1000 --interval 30 --pushes 1000   # ~35 s of pushes

Table on stdout, progress on stderr, results in bench/results/load.json.
"""
from __future__ import annotations

import logging
import math
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import coordinator_process, format_table
from bench.harness import Bench, Run
from bench.loadgen import LoadPlan, run_in_process
from bench.shapes import MODELS, PROJECTIONS, lora_manifest, random_tensors
from protocol.cli import option
from protocol.client import CoordinatorClient
from protocol.errors import FedMoEError

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench.load")
FINGERPRINT = "10ad" * 16
def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def peak_rss_bytes(pid: int) -> dict[int, int]:
    """VmHWM of a process and its children, by pid (the kernel's own peak, no sampling needed)."""
    pids = [pid]
    try:
        pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    peaks = {}
    for p in pids:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        if m := re.search(r"^VmHWM:\s+(\d+) kB", status, re.M):
            peaks[p] = int(m.group(1)) * 1024
    return peaks


@dataclass(frozen=True)
class Settings:
    workers: int = option(100, "simulated workers")
    rounds: int = option(2, "pushes per worker")
    experts: int = option(4, "experts the workers share")
    model: str = option("qwen2-0.5b", "shapes of the LoRA update", choices=sorted(MODELS))
    rank: int = 8
    codec: str = option("int8", "compression codec of the updates")
    aggregation: str = option("fedbuff", "the coordinator's --aggregation", choices=("fedasync", "fedbuff"))
    buffer_size: int = option(10, "fedbuff K")
    seed: int = 0
    mode: str = option("closed", "closed: each worker pushes --rounds times back to back (throughput); open: each of "
                       "--workers pushes every --interval s from a random phase until --pushes were sent",
                       choices=("closed", "open"))
    interval: float = option(30.0, "open mode: sync interval s")
    pushes: int = option(1000, "open mode: pushes in all")
    threads: int = option(16, "coordinator --threads")
    digest: str = option("blake3", "body digest the load sends (sha256 for a coordinator before 0.7)",
                         choices=("blake3", "sha256"))

    def __post_init__(self) -> None:
        for name in ("workers", "rounds", "experts", "buffer_size", "pushes", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not self.interval > 0:
            raise ValueError(f"--interval must be positive, got {self.interval}")


QUICK = {"workers": 8, "model": "tiny-qwen2", "buffer_size": 2, "interval": 1.0, "pushes": 16}
"""The smoke run (tests/bench): 8 workers on tiny-qwen2 shapes, fedbuff K=2."""


@dataclass
class Pushed:
    update_id: str
    expert: str
    num_samples: int
    seconds: float
    status: str  # "accepted" (202), "duplicate" (200), or the error


def verify(url: str, pushed: list[Pushed], experts: list[str]) -> dict[str, Any]:
    """lost: acknowledged ids the server does not know; duplicated: updates counted more than once."""
    client = CoordinatorClient(url)
    known: dict[str, dict[str, Any]] = {}
    lost = 0
    for p in pushed:
        try:
            known[p.update_id] = client.updates.status(p.update_id)
        except FedMoEError:
            lost += p.status in ("accepted", "duplicate")
    duplicated = 0
    for name in experts:
        info = client.experts.get(name)
        mine = [p for p in pushed if p.expert == name and p.update_id in known]
        applied = [p for p in mine if known[p.update_id]["status"] == "applied"]
        duplicated += max(0, info["updates_applied"] + info["pending_updates"] - len(mine))
        if info["samples_seen"] != sum(p.num_samples for p in applied):
            duplicated += 1  # samples counted twice (or lost) even if the counts agree
    client.close()
    return {"lost": lost, "duplicated": duplicated, "known": len(known)}


def create_experts(url: str, settings: Settings, experts: list[str], token: str | None = None) -> None:
    manifest = lora_manifest(settings.model, settings.rank)
    setup = CoordinatorClient(url, token=token)
    spec = {"lora": {"rank": settings.rank, "alpha": 2.0 * settings.rank, "target_modules": list(PROJECTIONS)},
            "base_model": {"id": settings.model, "fingerprint": FINGERPRINT}}
    for i, name in enumerate(experts):
        setup.experts.create(name, random_tensors(manifest, 10_000 + i, 0.01), spec)
    setup.close()


def load_plan(urls: list[str], admin_token: str, settings: Settings, experts: list[str]) -> LoadPlan:
    return LoadPlan(urls=urls, admin_token=admin_token, experts=experts, model=settings.model, rank=settings.rank,
                    codec=settings.codec, mode=settings.mode, workers=settings.workers, rounds=settings.rounds,
                    interval=settings.interval, pushes=settings.pushes, seed=settings.seed, fingerprint=FINGERPRINT,
                    digest=settings.digest)


def summarise(settings: Settings, load: dict[str, Any], checked: dict[str, Any]) -> dict[str, Any]:
    results = [Pushed(**{k: r[k] for k in ("update_id", "expert", "num_samples", "seconds", "status")})
               for r in load["results"]]
    latencies = [p.seconds for p in results]
    errors = [p.status for p in results if p.status not in ("accepted", "duplicate")]
    return {
        "settings": settings.__dict__, "parameters_per_update": sum(math.prod(s) for _, s in lora_manifest(
            settings.model, settings.rank)),
        "body_bytes_per_update": load["pool_body_bytes"],
        "pushes": len(results), "acknowledged": len(results) - len(errors), "errors": errors[:20],
        "retried": sum(r["attempts"] > 1 for r in load["results"]), "late_starts": load["late_starts"],
        "lost": checked["lost"], "duplicated": checked["duplicated"],
        "latency_s": {"p50": round(percentile(latencies, 50), 4), "p95": round(percentile(latencies, 95), 4),
                      "p99": round(percentile(latencies, 99), 4), "max": round(max(latencies), 4)},
        "pushes_per_s": round(len(results) / load["seconds"], 2),
        "mb_per_s": round(load["body_bytes"] / load["seconds"] / 1e6, 1),
        "push_seconds": round(load["seconds"], 2), "encode_seconds": round(load["encode_seconds"], 2),
        "generator_cpu_s_per_push": round(load["cpu_seconds"] / max(1, len(results)), 4),
    }


def run(settings: Settings) -> dict[str, Any]:
    torch.set_num_threads(1)
    experts = [f"load_expert_{i}" for i in range(settings.experts)]
    # on disk (durability included); its own process group, so that stopping it stops all it started
    with tempfile.TemporaryDirectory(prefix="fedmoe-load-") as data_dir, coordinator_process(
            Path(data_dir), "--aggregation", settings.aggregation, "--buffer-size", str(settings.buffer_size),
            "--threads", str(settings.threads), new_session=True) as server:
        create_experts(server.url, settings, experts)
        log.info("%s load: %d workers, generator in its own process", settings.mode, settings.workers)
        cpu_before = process_cpu_seconds(server.pid)  # startup (importing torch) is not the pushes' cost
        loop_before = process_cpu_seconds(server.pid, thread=server.pid)  # the main thread runs the front's loop
        load = run_in_process(load_plan([server.url], server.headers["Authorization"].split()[1], settings, experts))
        results = [Pushed(**{k: r[k] for k in ("update_id", "expert", "num_samples", "seconds", "status")})
                   for r in load["results"]]
        checked = verify(server.url, results, experts)
        peaks = peak_rss_bytes(server.pid)
        cpu = process_cpu_seconds(server.pid) - cpu_before
        loop_cpu = process_cpu_seconds(server.pid, thread=server.pid) - loop_before
        group = group_commit_counts(server.url, server.headers)
    # the front's own count of who read the large bodies (a line at its shutdown; coordinators from before 0.9 have none)
    read_by = server.lines(lambda line: "large bodies read on body threads" in line, timeout=3.0)
    report = summarise(settings, load, checked)
    found = re.search(r"front: (\d+) large bodies read on body threads, (\d+) by the event loop", "".join(read_by))
    report["front_bodies"] = {"thread": int(found.group(1)), "loop": int(found.group(2))} if found else None
    report["group_commit"] = group
    report["coordinator_cpu_s_per_push"] = round(cpu / max(1, len(results)), 4)
    report["front_loop_cpu_s_per_push"] = round(loop_cpu / max(1, len(results)), 4)
    report["front_loop_core_share"] = round(loop_cpu / max(1e-9, load["seconds"]), 3)
    report["coordinator_peak_rss_mb"] = {"max_process": round(max(peaks.values()) / 2**20, 1),
                                         "sum_processes": round(sum(peaks.values()) / 2**20, 1),
                                         "processes": len(peaks)}
    report["server_errors"] = [line.strip() for line in server.log if "unhandled error" in line][:20]
    return report


def group_commit_counts(url: str, headers: dict[str, str]) -> dict[str, float] | None:
    """Writes that waited to be durable and the flushes that served them (GET /metrics); None before 0.8."""
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=headers), timeout=30) as r:
        text = r.read().decode()
    found = dict(re.findall(r"^fedmoe_store_(syncs|flushes)_total ([0-9.e+]+)$", text, re.M))
    if len(found) != 2:
        return None
    syncs, flushes = float(found["syncs"]), float(found["flushes"])
    return {"syncs": syncs, "flushes": flushes, "writes_per_flush": round(syncs / max(1.0, flushes), 2)}


def process_cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User + system CPU seconds a live process (or one of its threads) has used so far (/proc/<pid>/stat)."""
    stat = Path(f"/proc/{pid}/stat") if thread is None else Path(f"/proc/{pid}/task/{thread}/stat")
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_bench(s: Settings, ctx: Run) -> int:
    report = run(s)
    ctx.write(report)
    lat = report["latency_s"]
    print(format_table(
        ["mode", "workers", "pushes", "MB/push", "lost", "dup", "retried", "p50 s", "p95 s", "p99 s", "pushes/s",
         "MB/s", "CPU s/push", "loop CPU s/push", "peak RSS MB"],
        [[s.mode, s.workers, report["pushes"], round(report["body_bytes_per_update"] / 1e6, 2),
          report["lost"], report["duplicated"], report["retried"], lat["p50"], lat["p95"], lat["p99"],
          report["pushes_per_s"], report["mb_per_s"], report["coordinator_cpu_s_per_push"],
          report["front_loop_cpu_s_per_push"],
          report["coordinator_peak_rss_mb"]["max_process"]]]))
    bad = report["lost"] or report["duplicated"] or report["errors"] or report["server_errors"]
    for line in report["errors"] + report["server_errors"]:
        print("ERROR:", line)
    return 1 if bad else 0


BENCH = Bench("load", tags=("performance",), settings=Settings, run=run_bench, quick=QUICK)
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
