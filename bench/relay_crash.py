#!/usr/bin/env python3
"""Relay crash benchmark: kill -9 a relay at random moments while workers push through it.

A real root (fedasync, staleness decay 0) and a real relay (run_coordinator.py --upstream, its own
process group, a fixed loopback port so clients keep their URL) serve a tiny expert. Client threads
register at the relay with the root's join token and push small real updates (unique update_ids,
random num_samples), retrying an unanswered push with the same id and bytes, as a worker's outbox
does. At random moments the relay's process group gets SIGKILL and is restarted on its data dir.
At the end, once the relay has forwarded everything, the root must have seen exactly the samples
of the acknowledged updates: an update lost would be missing from samples_seen, one applied twice
would be counted twice (num_samples differ, so a loss and a duplicate do not cancel out).

    python -m bench.relay_crash              # 20 kills
    python -m bench.relay_crash --kills 3    # a quick look

Table on stdout, results in bench/results/relay_crash.json.
"""
from __future__ import annotations

import json
import random
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import torch

from bench.common import CoordinatorProcess, format_table
from bench.harness import Bench, Run
from protocol.cli import option
from protocol.integrity import DIGEST_HEADER, digest_header
from protocol.schemas import EXPERT_HEADER, UPDATE_HEADER
from protocol.tensors import dumps

EXPERT = "relay_crash_expert"
FINGERPRINT = "ef" * 32
SPEC: dict[str, Any] = {"lora": {"rank": 2, "alpha": 4.0, "target_modules": ["q_proj"]},
                        "base_model": {"id": "tiny-test", "fingerprint": FINGERPRINT}}


def tiny_adapter(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight":
            torch.randn(*(2, 8) if ab == "A" else (8, 2), generator=g) * scale for i in range(2) for ab in "AB"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PushingClient(threading.Thread):
    """One worker: pushes until told to stop, each update retried (same id, same bytes) until acknowledged."""

    def __init__(self, url: str, join_token: str, index: int, seed: int, stop: threading.Event,
                 pull: bool = False) -> None:
        super().__init__(daemon=True)
        self.url, self.index, self.stop_event = url, index, stop
        self.pull = pull
        """Pull the weights after each acknowledged push, as a worker does (a --site-model relay builds them then)."""
        self.rng = random.Random(seed * 1000 + index)
        self.worker_id = f"crash-w{index}"
        self.acked: dict[str, int] = {}
        self.pulled = 0
        """Pulls answered with weights (a dropped connection while the relay is down is not one)."""
        self.server_errors: list[str] = []
        self.token = self._register(join_token)

    def _register(self, join_token: str) -> str:
        body = {"worker_id": self.worker_id, "specialty": EXPERT, "base_model": SPEC["base_model"]}
        r = requests.post(f"{self.url}/api/v1/workers", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {join_token}"})
        r.raise_for_status()
        return r.json()["token"]

    def run(self) -> None:
        n = 0
        while not self.stop_event.is_set():
            n += 1
            update_id = f"{self.worker_id}-{n}"
            samples = self.rng.randint(1, 1000)
            body = dumps(tiny_adapter(self.rng.randint(0, 10**6), 0.01))
            self._push_until_acked(update_id, samples, body)
            if self.pull:
                self._pull()

    def _pull(self) -> None:
        try:
            r = requests.get(f"{self.url}/api/v1/experts/{EXPERT}/weights", timeout=30,
                             headers={"Authorization": f"Bearer {self.token}", "X-FedMoE-Worker": self.worker_id})
        except requests.RequestException:
            return  # the relay is down: the next sync pulls again
        if r.status_code >= 500 and r.status_code not in (503, 507):
            self.server_errors.append(f"pull: {r.status_code} {r.text[:200]}")
        elif r.status_code == 200 and r.content:
            self.pulled += 1

    def _push_until_acked(self, update_id: str, samples: int, body: bytes) -> None:
        meta = {"update_id": update_id, "base_version": 0, "num_samples": samples, "worker_id": self.worker_id}
        headers = {"Authorization": f"Bearer {self.token}", UPDATE_HEADER: json.dumps(meta),
                   DIGEST_HEADER: digest_header(body), "Content-Type": "application/octet-stream"}
        while True:
            try:
                r = requests.post(f"{self.url}/api/v1/experts/{EXPERT}/updates", data=body, headers=headers,
                                  timeout=30)
            except requests.RequestException:
                time.sleep(0.05)  # the relay is down: retry the same update
                continue
            if r.status_code in (200, 202):
                self.acked[update_id] = samples
                return
            if r.status_code >= 500 and r.status_code not in (503, 507):
                self.server_errors.append(f"{r.status_code} {r.text[:200]}")
            time.sleep(0.05)


def run(kills: int = 20, clients: int = 3, seed: int = 0, max_uptime: float = 1.5, work_dir: Path | None = None,
        settle_timeout: float = 60.0, site_model: bool = False) -> dict[str, Any]:
    rng = random.Random(seed)
    work_dir = Path(work_dir or tempfile.mkdtemp(prefix="relay-crash-"))
    root = CoordinatorProcess(work_dir / "root", "--staleness-decay", "0", "--rate-limit", "0")
    root.start()
    relay = None
    try:
        join_token = (work_dir / "root" / "join_token").read_text().strip()
        (work_dir / "join").write_text(join_token)
        port = free_port()
        relay = CoordinatorProcess(work_dir / "relay", "--port", str(port), "--upstream", root.url,
                                   "--join-token-file", str(work_dir / "join"), "--relay-join-token-file",
                                   str(work_dir / "root" / "relay_join_token"), "--forward-interval", "0.2",
                                   "--relay-id", "crash-relay", "--rate-limit", "0", "--staleness-decay", "0",
                                   *(["--site-model"] if site_model else []), new_session=True)
        relay.start()
        body = dumps(tiny_adapter(seed))
        created = requests.put(f"{root.url}/api/v1/experts/{EXPERT}", data=body, timeout=30,
                               headers={**root.headers, EXPERT_HEADER: json.dumps(SPEC),
                                        DIGEST_HEADER: digest_header(body)})
        created.raise_for_status()
        stop = threading.Event()
        pushers = [PushingClient(relay.url, join_token, i, seed, stop, pull=site_model) for i in range(clients)]
        for p in pushers:
            p.start()
        restarts = []
        for _ in range(kills):
            time.sleep(rng.uniform(0.1, max_uptime))
            relay.kill()
            restarts.append(relay.start())
        stop.set()
        for p in pushers:
            p.join(timeout=120)
        acked = {k: v for p in pushers for k, v in p.acked.items()}
        expected = sum(acked.values())
        seen = _wait_for_samples(root, expected, settle_timeout)
        expert = requests.get(f"{root.url}/api/v1/experts/{EXPERT}", headers=root.headers, timeout=30).json()
        tree = requests.get(f"{root.url}/api/v1/relays", headers=root.headers, timeout=30).json()["relays"]
    finally:
        if relay is not None:
            relay.stop()
        root.stop()
    return {"kills": kills, "clients": clients, "seed": seed, "pushes_acknowledged": len(acked),
            "samples_acknowledged": expected, "root_samples_seen": seen, "root_updates_applied":
            expert["updates_applied"], "restart_s": restarts,
            "server_errors": [e for p in pushers for e in p.server_errors],
            "pulls_answered": sum(p.pulled for p in pushers),
            "relay_stats": tree[0]["stats"] if tree else {}}


def _wait_for_samples(root: CoordinatorProcess, expected: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    seen = -1
    while time.monotonic() < deadline:
        seen = requests.get(f"{root.url}/api/v1/experts/{EXPERT}", headers=root.headers,
                            timeout=30).json()["samples_seen"]
        if seen >= expected:
            time.sleep(0.5)  # anything applied twice would show up now
            return requests.get(f"{root.url}/api/v1/experts/{EXPERT}", headers=root.headers,
                                timeout=30).json()["samples_seen"]
        time.sleep(0.1)
    return seen


@dataclass(frozen=True)
class Settings:
    kills: int = option(20, "kill -9 / restart cycles of the relay")
    clients: int = option(3, "pushing workers behind the relay")
    seed: int = option(0, "seed of the kill moments")
    site_model: bool = option(False, "the relay with --site-model; clients pull after each push")

    def __post_init__(self) -> None:
        if self.kills < 1 or self.clients < 1:
            raise ValueError("--kills and --clients must be at least 1")


def run_bench(s: Settings, ctx: Run) -> int:
    report = run(s.kills, s.clients, s.seed, site_model=s.site_model)
    restarts = sorted(report["restart_s"])
    print(format_table(["kills", "pushes acked", "samples acked", "root samples", "root updates", "restart s (median)"],
                       [[report["kills"], report["pushes_acknowledged"], report["samples_acknowledged"],
                         report["root_samples_seen"], report["root_updates_applied"],
                         f"{restarts[len(restarts) // 2]:.2f}" if restarts else "-"]]))
    ctx.write(report)
    ok = report["root_samples_seen"] == report["samples_acknowledged"] and not report["server_errors"]
    return 0 if ok else 1


BENCH = Bench("relay_crash", tags=("durability",), settings=Settings, run=run_bench, quick={"kills": 3})
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
