#!/usr/bin/env python3
"""Crash benchmark: kill -9 the coordinator at random moments while clients push, and check it after each restart.

A real run_coordinator.py (its own process group) serves a tiny expert.
Client threads push small real updates (safetensors deltas, unique update_ids, distinct num_samples),
retrying an unanswered push with the same update_id and bytes as a real worker does. At a random
moment the whole process group gets SIGKILL; the coordinator restarts on the same data dir and,
before the clients resume, is checked:

- every acknowledged (2xx) update is known, pending or applied (GET /api/v1/updates/<id>);
- updates_applied and samples_seen equal the count and sum over the updates the server calls
  applied (an update applied twice would add its samples twice);
- the weights served parse as safetensors and equal the initial adapter plus the sum of the
  applied deltas (fedasync, staleness decay 0: exactly-once shows in the numbers);
- every blob file's SHA-256 equals its name, and nothing half-written is left in the temp dir.

Restart time is from spawning the process to the first answered /health.

    python -m bench.crash                # 50 kills, ~2-3 min on 2 cores
    python -m bench.crash --kills 5      # a quick look

Table on stdout, progress on stderr, results in bench/results/crash.json.
"""
from __future__ import annotations

import json
import logging
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests
import torch

from bench.common import CoordinatorProcess, format_table
from bench.harness import Bench, Run
from protocol.cli import option
from protocol.integrity import algorithm_of, hash_file
from protocol.schemas import EXPERT_HEADER, UPDATE_HEADER
from protocol.tensors import dumps, loads

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench.crash")
EXPERT = "crash_expert"
FINGERPRINT = "cd" * 32


def tiny_adapter(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A rank-2 LoRA adapter on two projections of two layers: pushes stay small and fast."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            out[f"{key}.lora_A.weight"] = torch.randn(2, 8, generator=g) * scale
            out[f"{key}.lora_B.weight"] = torch.randn(8, 2, generator=g) * scale
    return out


@dataclass
class Push:
    """One update a client means to deliver, and what it learnt about it."""

    update_id: str
    num_samples: int
    body: bytes
    acked: bool = False


class Clients:
    """Threads that push updates whenever the server is up, retrying each until it is acknowledged."""

    def __init__(self, server: CoordinatorProcess, threads: int, seed: int) -> None:
        self.server = server
        self.up = threading.Event()
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.pushes: list[Push] = []
        self.in_flight = 0
        self.errors: list[str] = []
        self._rng = random.Random(seed)
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def pause(self) -> None:
        """Stop starting pushes and wait for those in flight (the server is dead: they fail fast)."""
        self.up.clear()
        while True:
            with self.lock:
                if self.in_flight == 0:
                    return
            time.sleep(0.005)

    def stop(self) -> None:
        self.stopping.set()
        self.up.set()
        for t in self._threads:
            t.join(timeout=30)

    def _run(self, index: int) -> None:
        session = requests.Session()
        session.headers.update(self.server.headers)
        n = 0
        while not self.stopping.is_set():
            n += 1
            seed = index * 1_000_000 + n
            with self.lock:
                samples = 1 + self._rng.randrange(1000)
            push = Push(f"client{index}-{n}", samples, dumps(tiny_adapter(seed, scale=0.01)))
            with self.lock:
                self.pushes.append(push)
            while not push.acked and not self.stopping.is_set():
                self.up.wait()
                if self.stopping.is_set():
                    break
                self._try(session, push)

    def _try(self, session: requests.Session, push: Push) -> None:
        with self.lock:
            if not self.up.is_set():
                return
            self.in_flight += 1
            url = self.server.url
        try:
            meta = {"update_id": push.update_id, "base_version": 0, "num_samples": push.num_samples}
            r = session.post(f"{url}/api/v1/experts/{EXPERT}/updates", data=push.body,
                             headers={UPDATE_HEADER: json.dumps(meta)}, timeout=(2, 30))
            if r.status_code in (200, 202):
                push.acked = True
            else:
                with self.lock:
                    self.errors.append(f"{push.update_id}: HTTP {r.status_code} {r.text[:200]}")
        except requests.RequestException:
            time.sleep(0.01)  # killed mid-request: retry the same update_id and bytes once it is back
        finally:
            with self.lock:
                self.in_flight -= 1


@dataclass
class Check:
    """What one post-restart check saw."""

    acked: int
    applied: int
    pending: int
    version: int
    blobs: int
    problems: list[str] = field(default_factory=list)


def check(server: CoordinatorProcess, pushes: Sequence[Push], initial: dict[str, torch.Tensor],
          session: requests.Session) -> Check:
    """Everything acknowledged is there once; counters, weights and blobs agree with that."""
    api = server.url + "/api/v1"
    problems = []
    status: dict[str, str] = {}
    for push in pushes:
        r = session.get(f"{api}/updates/{push.update_id}", timeout=30)
        if r.status_code == 200:
            status[push.update_id] = r.json()["status"]
        elif push.acked:
            problems.append(f"acknowledged update {push.update_id} is unknown (HTTP {r.status_code})")
    applied = [p for p in pushes if status.get(p.update_id) == "applied"]
    info = session.get(f"{api}/experts/{EXPERT}", timeout=30).json()
    expected = (len(applied), sum(p.num_samples for p in applied), len(applied))
    got = (info["updates_applied"], info["samples_seen"], info["version"])
    if got != expected:
        problems.append(f"(updates_applied, samples_seen, version) = {got}, expected {expected}")
    pending = sum(1 for s in status.values() if s == "pending")
    if info["pending_updates"] != pending:
        problems.append(f"pending_updates {info['pending_updates']} but {pending} updates say pending")
    weights = loads(session.get(f"{api}/experts/{EXPERT}/weights", timeout=30).content)
    want = {k: v.clone() for k, v in initial.items()}
    for p in applied:
        for k, d in loads(p.body).items():
            want[k] += d
    worst = max(float((weights[k] - want[k]).abs().max()) for k in want)
    if set(weights) != set(want) or worst > 1e-4:
        problems.append(f"weights differ from initial + applied deltas by {worst:.3g}")
    # The gateway is rebuilt in the background after a restart; once a read returns it, its temp file
    # has been moved into the store, so what is left in tmp/ below is a crash's leftover.
    session.get(f"{api}/gateway", timeout=60)
    blobs = 0
    for path in (server.data_dir / "blobs").glob("*/*"):
        if path.parent.name == "tmp":
            continue
        blobs += 1
        if hash_file(path, algorithm_of(path.name)) != path.name:
            problems.append(f"blob {path.name} does not match its hash")
    leftovers = list((server.data_dir / "blobs" / "tmp").iterdir())
    if leftovers:
        problems.append(f"{len(leftovers)} temp file(s) left after start")
    return Check(sum(p.acked for p in pushes), len(applied), pending, info["version"], blobs, problems)


def run(kills: int, clients: int = 4, seed: int = 0, max_uptime: float = 0.4,
        data_dir: Path | None = None) -> dict[str, Any]:
    """Kill and restart the coordinator ``kills`` times; the report (``problems`` empty when all held)."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="fedmoe-crash-") as tmp:
        # its own process group: one SIGKILL takes master and worker down together
        server = CoordinatorProcess(Path(data_dir or tmp), "--staleness-decay", "0", "--threads", "8",
                                    new_session=True)
        initial = tiny_adapter(seed)
        restarts: list[float] = []
        checks: list[Check] = []
        first_start = server.start()
        spec = {"lora": {"rank": 2, "alpha": 4.0, "target_modules": ["q_proj", "v_proj"]},
                "base_model": {"id": "crash-test", "fingerprint": FINGERPRINT}}
        r = requests.put(f"{server.url}/api/v1/experts/{EXPERT}", data=dumps(initial),
                         headers={**server.headers, EXPERT_HEADER: json.dumps(spec)}, timeout=30)
        r.raise_for_status()
        pushers = Clients(server, clients, seed)
        session = requests.Session()
        session.headers.update(server.headers)
        started = time.monotonic()
        try:
            pushers.start()
            for k in range(kills):
                pushers.up.set()
                time.sleep(rng.uniform(0.0, max_uptime))
                server.kill()
                pushers.pause()
                restarts.append(server.start())
                with pushers.lock:
                    snapshot = list(pushers.pushes)
                checks.append(check(server, snapshot, initial, session))
                log.info("kill %d/%d: restart %.2f s, %d acknowledged, %d applied, %d pending, %s",
                         k + 1, kills, restarts[-1], checks[-1].acked, checks[-1].applied, checks[-1].pending,
                         "ok" if not checks[-1].problems else checks[-1].problems)
            pushers.up.set()
            time.sleep(0.2)
        finally:
            pushers.stop()
            server.stop()
        seconds = time.monotonic() - started
    problems = [p for c in checks for p in c.problems] + pushers.errors
    unhandled = [line for line in server.log if "unhandled error" in line]
    return {
        "kills": kills, "clients": clients, "seed": seed, "seconds": round(seconds, 2),
        "first_start_s": round(first_start, 3),
        "restart_s": {"p50": round(statistics.median(restarts), 3), "max": round(max(restarts), 3),
                      "all": [round(x, 3) for x in restarts]} if restarts else None,
        "pushes_acknowledged": checks[-1].acked if checks else 0,
        "updates_applied": checks[-1].applied if checks else 0,
        "server_errors": unhandled, "problems": problems,
        "checks": [asdict(c) for c in checks],
    }


@dataclass(frozen=True)
class Settings:
    kills: int = option(50, "kill -9 / restart cycles")
    clients: int = option(4, "pushing client threads")
    max_uptime: float = option(0.4, "the kill comes 0..this many seconds after the server is up")
    seed: int = option(0, "seed of the kill moments and the updates")

    def __post_init__(self) -> None:
        if self.kills < 1 or self.clients < 1 or not self.max_uptime > 0:
            raise ValueError("--kills and --clients must be at least 1 and --max-uptime positive")


def run_bench(s: Settings, ctx: Run) -> int:
    report = run(s.kills, s.clients, s.seed, s.max_uptime)
    ctx.write(report)
    rows = [[report["kills"], report["clients"], report["pushes_acknowledged"], report["updates_applied"],
             report["restart_s"]["p50"], report["restart_s"]["max"], len(report["problems"]),
             len(report["server_errors"]), report["seconds"]]]
    print(format_table(["kills", "clients", "acked", "applied", "restart p50 s", "restart max s", "problems",
                        "5xx", "seconds"], rows))
    for problem in report["problems"][:20]:
        print("PROBLEM:", problem)
    return 1 if report["problems"] or report["server_errors"] else 0


BENCH = Bench("crash", tags=("robustness", "durability"), settings=Settings, run=run_bench, quick={"kills": 5}, torch_threads=1)
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
