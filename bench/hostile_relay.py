"""Relay poisoning (issue 30, item 1): the ``relay_poisoning`` part of ``python -m bench.hostile``.

One worker behind a real relay pushes finite deltas of 3e38 with a large ``num_samples`` among honest workers,
against a relay without and with ``--site-model``. Before the fix the relay acknowledged every such push, the batch
carrying the second overflowed at the root (422), and the relay dropped it with every member: 6 of 9 honest
updates that had their 202 were never applied, and a site-model relay served weights holding Inf.

Real run_coordinator.py processes: a root and a relay (``--upstream``, ``--forward-interval 0.5``). Each round
three honest workers push and the attacker pushes, then the relay forwards (``POST /api/v1/forward``, the admin's
"now"; its own interval runs too), while an honest client (a worker of its own) pushes and pulls on a thread,
each request timed. Then the relay is drained and every acknowledged update is looked up at the root.

Reported per mode: requests sent, 5xx, requests with no answer, the attacker's pushes acknowledged / refused
before the 202 / applied at the root; honest acknowledged updates lost (not applied at the root) and samples
doubled (the root's ``samples_seen`` over the sum of what it applied); pulls holding Inf or NaN; and the honest
client's push and pull p50/p99 during the attack. Targets: 0 lost, 0 doubled, 0 non-finite pulls, 0 5xx.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import torch

import bench.common
from bench.common import CoordinatorProcess, format_table
from bench.harness import git_head
from bench import attacks
from bench.attacks import Tally, percentiles
from protocol.integrity import DIGEST_HEADER, digest_header
from protocol.schemas import EXPERT_HEADER, UPDATE_HEADER
from protocol.tensors import dumps, loads
from bench.updates import FINGERPRINT, expert_spec, make_adapter, random_like

log = logging.getLogger("bench.hostile")
EXPERT = "python_expert"
HONEST = ("h1", "h2", "h3")
FORWARD_INTERVAL = "0.5"


class Site:
    """A root and a relay in front of it, and raw HTTP calls to them, every answer counted in ``tally``."""

    def __init__(self, root: CoordinatorProcess, relay: CoordinatorProcess, join: str) -> None:
        self.root, self.relay, self.join = root, relay, join
        self.tally = Tally()
        self.tokens: dict[str, str] = {}

    def register(self, worker_id: str) -> None:
        r = requests.post(f"{self.relay.url}/api/v1/workers", timeout=30, headers={"Authorization": f"Bearer {self.join}"},
                          json={"worker_id": worker_id, "specialty": EXPERT,
                                "base_model": {"id": "tiny-test", "fingerprint": FINGERPRINT}})
        assert r.status_code == 200, r.text
        self.tokens[worker_id] = r.json()["token"]

    def push(self, worker_id: str, delta: dict[str, torch.Tensor], samples: int) -> tuple[str, requests.Response | None]:
        update_id = f"{worker_id}-{uuid.uuid4().hex[:12]}"
        meta = {"update_id": update_id, "base_version": 0, "num_samples": samples, "worker_id": worker_id}
        body = dumps(delta)
        return update_id, self._send(f"push {update_id}", lambda: requests.post(
            f"{self.relay.url}/api/v1/experts/{EXPERT}/updates", data=body, timeout=60,
            headers={"Authorization": f"Bearer {self.tokens[worker_id]}", UPDATE_HEADER: json.dumps(meta),
                     DIGEST_HEADER: digest_header(body)}))

    def pull(self, worker_id: str) -> requests.Response | None:
        return self._send(f"pull {uuid.uuid4().hex[:8]}", lambda: requests.get(
            f"{self.relay.url}/api/v1/experts/{EXPERT}/weights", timeout=60,
            headers={"Authorization": f"Bearer {self.tokens[worker_id]}", "X-FedMoE-Worker": worker_id}))

    def forward(self) -> dict[str, Any]:
        r = self._send(f"forward {uuid.uuid4().hex[:8]}", lambda: requests.post(
            f"{self.relay.url}/api/v1/forward", headers=self.relay.headers, timeout=120))
        return r.json() if r is not None and r.status_code == 200 else {}

    def at_root(self, path: str) -> dict[str, Any]:
        r = self._send(f"root {path}", lambda: requests.get(f"{self.root.url}/api/v1{path}", headers=self.root.headers,
                                                            timeout=60))
        return r.json() if r is not None else {}

    def _send(self, name: str, call: Callable[[], requests.Response]) -> requests.Response | None:
        """``call`` counted in the tally (the client thread's too: each name is unique, each count one append)."""
        answer: list[requests.Response] = []

        def kept() -> requests.Response:
            answer.append(call())
            return answer[-1]

        self.tally.send(name, kept)
        return answer[-1] if answer else None


@dataclass
class Attacker:
    acknowledged: list[str] = field(default_factory=list)
    """Update ids of the poisoned pushes the relay answered 202."""
    refused_before_202: int = 0


class HonestClient(threading.Thread):
    """A worker pushing and pulling through the relay during the attack: latencies, acknowledged ids, bad pulls."""

    def __init__(self, site: Site, adapter: dict[str, torch.Tensor]) -> None:
        super().__init__(name="honest-client", daemon=True)
        self.site, self.adapter = site, adapter
        self.stop = threading.Event()
        self.push_s: list[float] = []
        self.pull_s: list[float] = []
        self.acked: dict[str, int] = {}
        self.non_finite_pulls = 0

    def run(self) -> None:
        seed = 1000
        while not self.stop.is_set():
            seed += 1
            started = time.perf_counter()
            update_id, answer = self.site.push("client", random_like(self.adapter, seed), 10)
            if answer is not None and answer.status_code < 500:
                self.push_s.append(time.perf_counter() - started)
                if answer.status_code == 202:
                    self.acked[update_id] = 10
            started = time.perf_counter()
            pulled = self.site.pull("client")
            if pulled is not None and pulled.status_code == 200:
                self.pull_s.append(time.perf_counter() - started)
                self.non_finite_pulls += not finite(loads(pulled.content))


def finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values())


def poison(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Finite (float32 reaches 3.4e38), and twice it is not."""
    return {k: torch.full_like(v, 3e38) for k, v in adapter.items()}


def attack(site: Site, rounds: int) -> dict[str, Any]:
    """``rounds`` rounds of honest pushes and a poisoned one, the honest client running meanwhile; then drain."""
    adapter = make_adapter(rank=4, layers=4, d_in=32, d_out=32)
    for worker in ("evil", "client", *HONEST):
        site.register(worker)
    honest: dict[str, int] = {}
    evil = Attacker()
    client = HonestClient(site, adapter)
    client.start()
    for round_ in range(rounds):
        for i, worker in enumerate(HONEST):
            update_id, answer = site.push(worker, random_like(adapter, 10 * round_ + i), 10)
            if answer is not None and answer.status_code == 202:
                honest[update_id] = 10
        update_id, answer = site.push("evil", poison(adapter), 10 ** 6)
        if answer is not None and answer.status_code == 202:
            evil.acknowledged.append(update_id)
        elif answer is not None and answer.status_code == 422:
            evil.refused_before_202 += 1
        site.forward()
    client.stop.set()
    client.join(timeout=120)
    for _ in range(20):  # drain: whatever is queued goes upstream
        if site.forward().get("queued_bytes", 1) == 0:
            break
        time.sleep(0.2)
    return outcome(site, honest | client.acked, evil, client)


def outcome(site: Site, honest: dict[str, int], evil: Attacker, client: HonestClient) -> dict[str, Any]:
    """What became of every acknowledged update, looked up at the root."""
    statuses = {u: site.at_root(f"/updates/{u}").get("status") for u in [*honest, *evil.acknowledged]}
    applied_samples = sum(n for u, n in honest.items() if statuses[u] == "applied") + \
        10 ** 6 * sum(statuses[u] == "applied" for u in evil.acknowledged)
    final = site.pull("client")
    non_finite = client.non_finite_pulls + (final is not None and final.status_code == 200
                                            and not finite(loads(final.content)))
    statuses_seen = Counter(str(c["status"]) for c in site.tally.cases.values())
    return site.tally.summary() | {
        "statuses": dict(sorted(statuses_seen.items())),
        "honest_acknowledged": len(honest),
        "honest_lost": sorted(u for u in honest if statuses[u] != "applied"),
        "samples_doubled": site.at_root(f"/experts/{EXPERT}").get("samples_seen", 0) - applied_samples,
        "attacker": {"acknowledged": len(evil.acknowledged), "refused_before_202": evil.refused_before_202,
                     "applied": sum(statuses[u] == "applied" for u in evil.acknowledged)},
        "non_finite_pulls": int(non_finite),
        "client_push": percentiles(client.push_s), "client_pull": percentiles(client.pull_s),
        "client_requests": len(client.push_s) + len(client.pull_s)}


def relay_poisoning(data_dir: Path, rounds: int) -> dict[str, Any]:
    """The attack against a relay without and with ``--site-model`` (a fresh root and relay for each).

    The site model runs at ``--async-alpha 1`` (each update whole in the site's weights): at its default, 1 / the
    site's five workers, three poisoned deltas of 3e38 never overflow, and the overflow checks this attack is about
    would not be reached."""
    report: dict[str, Any] = {}
    for mode, extra in (("plain", ()), ("site_model", ("--site-model", "--async-alpha", "1"))):
        directory = data_dir / mode
        root = CoordinatorProcess(directory / "root", "--rate-limit", "0")
        root.start()
        relay = None
        try:
            r = requests.put(f"{root.url}/api/v1/experts/{EXPERT}", timeout=60, data=dumps(make_adapter(
                rank=4, layers=4, d_in=32, d_out=32)), headers={**root.headers, EXPERT_HEADER: json.dumps(
                    expert_spec(rank=4))})
            assert r.status_code == 201, r.text
            relay = CoordinatorProcess(directory / "relay", "--rate-limit", "0", "--upstream", root.url,
                                       "--join-token-file", str(directory / "root" / "join_token"),
                                       "--relay-join-token-file", str(directory / "root" / "relay_join_token"),
                                       "--forward-interval", FORWARD_INTERVAL, *extra)
            relay.start()
            site = Site(root, relay, (directory / "root" / "join_token").read_text().strip())
            report[mode] = attack(site, rounds)
            log.info("relay poisoning (%s): %s", mode, {k: v for k, v in report[mode].items() if k != "unexpected"})
        finally:
            if relay is not None:
                relay.stop()
            root.stop()
    return report | {"rounds": rounds, "commit": git_head(bench.common.ROOT), "load_average": [round(x, 2) for x in os.getloadavg()]}


def poisoning_table(part: dict[str, Any]) -> str:
    rows = [[mode, p["requests"], p["status_5xx"], p["no_answer"], f"{len(p['honest_lost'])}/{p['honest_acknowledged']}",
             p["samples_doubled"], f"{p['attacker']['acknowledged']}/{p['attacker']['refused_before_202']}/"
             f"{p['attacker']['applied']}", p["non_finite_pulls"], p["client_push"]["p99_s"], p["client_pull"]["p99_s"]]
            for mode, p in part.items() if isinstance(p, dict) and "requests" in p]
    return format_table(["relay_poisoning", "requests", "5xx", "no answer", "honest lost/acked", "samples doubled",
                         "attacker acked/refused/applied", "Inf pulls", "push p99 s", "pull p99 s"], rows)


@attacks.attack("relay_poisoning", table=poisoning_table,
                tallies=lambda part: [part[mode] for mode in ("plain", "site_model") if mode in part])
def relay_poisoning_attack(directory: Path, s: attacks.Settings) -> dict[str, Any]:
    """3e38 pushes behind a relay, plain and --site-model."""
    log.info("relay poisoning: 3e38 pushes behind a relay, plain and --site-model")
    return relay_poisoning(directory, rounds=s.relay_rounds)
