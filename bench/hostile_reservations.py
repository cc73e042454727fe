"""Reservation exhaustion (issue 30.2): resumable uploads opened and never sent, then an honest worker's pushes.

The attack as the issue's tester ran it, against a real run_coordinator.py on loopback: with only the workers' join
token, take every identity it gives (a relay token, if the root hands one out for it; worker ids, 2 open uploads
each) and open uploads of the largest body the root takes, sending nothing. The opens are sized to declare 1.25x
the data dir's free disk: a coordinator that reserved declared sizes against free disk then answers every later
open 507, the honest one included (89 opens of 1 GiB claimed 73 GiB in the report). Then one honest worker pushes
9 MiB updates through ``CoordinatorClient`` (resumable above 8 MiB; since issue 30 it falls back to one request
when an open is refused).

Reported: the requests the attack sent and their statuses (5xx among them), the bytes it left on disk, and for the
honest pushes how each went (resumable, one request, failed), their seconds (p50/p99) and the seconds from the
attack's start to the first honest push applied.

    python -m bench.hostile --only reservation_exhaustion
    python -m bench.hostile --only reservation_exhaustion --server-root /path/to/main   # before the fix
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

import bench.common
from bench.common import CoordinatorProcess, format_table
from bench import attacks
from bench.attacks import Tally, percentiles
from bench.harness import git_head
from protocol.client import CoordinatorClient
from protocol.errors import FedMoEError
from protocol.schemas import API_PREFIX, EXPERT_HEADER
from protocol.tensors import dumps
from bench.updates import expert_spec, make_adapter, random_like, update_meta

MiB = 1 << 20
EXPERT = "e"
OVERCLAIM = 1.25
"""The opens declare this many times the data dir's free disk."""

log = logging.getLogger("bench.hostile")


def reservation_exhaustion(data_dir: Path, identities: int = 45, opens_each: int = 2, relay_opens: int = 89,
                           honest_pushes: int = 5) -> dict[str, Any]:
    """Run the attack against a fresh coordinator on ``data_dir``, then the honest pushes; the report (module doc)."""
    load_at_start = os.getloadavg()
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(data_dir.parent)
    free = st.f_bavail * st.f_frsize
    max_body_mb = max(1024, math.ceil(OVERCLAIM * free / (identities * opens_each) / MiB))
    server = CoordinatorProcess(data_dir, "--max-body-mb", str(max_body_mb))
    server.start()
    try:
        adapter = make_adapter(rank=64, d_in=1024, d_out=1024, layers=9)  # 2 modules a layer: a 9 MiB update
        r = requests.put(f"{server.url}{API_PREFIX}/experts/{EXPERT}", data=dumps(adapter), timeout=120,
                         headers={**server.headers, EXPERT_HEADER: json.dumps(expert_spec(rank=64))})
        assert r.status_code == 201, r.text
        join = (data_dir / "join_token").read_text().strip()
        started = time.monotonic()
        tally = Tally()
        opens, declared = _open_and_never_send(server.url, join, tally, identities, opens_each, relay_opens,
                                               max_body_mb * MiB)
        attack = tally.summary() | {"seconds": round(time.monotonic() - started, 2),
                                    "statuses": dict(Counter(tally.statuses)),
                                    "status_507": tally.statuses.count(507),
                                    "relay_registration_with_join_token": tally.cases["relay registration"]["status"],
                                    "disk_bytes": sum(p.stat().st_size for p in (data_dir / "uploads").glob("*.part"))}
        honest = _honest_pushes(server.url, join, adapter, honest_pushes, started)
    finally:
        server.stop()
    return {"server": str(bench.common.ROOT), "commit": git_head(bench.common.ROOT),
            "load_average": {"start": load_at_start, "end": os.getloadavg()}, "identities": identities,
            "opens_each": opens_each, "max_body_mb": max_body_mb, "free_disk_gib": round(free / (1 << 30), 1),
            "opens": opens, "declared_gib": round(declared / (1 << 30), 1), "attack": attack, "honest": honest,
            "requests": attack["requests"] + honest["pushes"], "status_5xx": attack["status_5xx"]}


def _open_and_never_send(url: str, join: str, tally: Tally, identities: int, opens_each: int, relay_opens: int,
                         size: int) -> tuple[int, int]:
    """Every identity the join token gives opens uploads of ``size`` bytes and sends nothing (after a 507, of half as
    many: the rest of the disk is claimed too); (opens sent, bytes declared by the opens the coordinator took)."""
    api = url + API_PREFIX

    def bearer(token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    opens, declared = 0, 0

    def open_empty(name: str, token: str, worker_id: str) -> None:
        nonlocal opens, declared, size
        opens += 1
        digest = "sha256=" + uuid.uuid4().hex * 2  # of no body: none is ever sent
        r = _sent(tally, name, lambda: requests.post(f"{api}/experts/{EXPERT}/uploads", headers=bearer(token),
                                                     timeout=60, json={"update": update_meta(worker_id=worker_id),
                                                                       "size": size, "digest": digest}))
        if r is not None and r.status_code == 507:  # what is left is smaller: claim it in smaller opens
            size = max(MiB, size // 2)
        elif r is not None and r.status_code < 300:
            declared += size

    relay = _sent(tally, "relay registration", lambda: requests.post(f"{api}/relays", json={"relay_id": "attacker"},
                                                                     headers=bearer(join), timeout=60))
    if relay is not None and relay.status_code == 200:  # a relay token: its uploads had no owner, so no limit
        for k in range(relay_opens):
            open_empty(f"relay open {k}", relay.json()["token"], f"via-relay-{k}")
    for i in range(identities):
        worker_id = f"attacker-{i}"
        body = {"worker_id": worker_id, "specialty": EXPERT, "base_model": expert_spec(rank=64)["base_model"]}
        joined = _sent(tally, f"register {worker_id}", lambda: requests.post(f"{api}/workers", headers=bearer(join),
                                                                              json=body, timeout=60))
        if joined is not None and joined.status_code == 200:
            for k in range(opens_each):
                open_empty(f"{worker_id} open {k}", joined.json()["token"], worker_id)
    return opens, declared


def _sent(tally: Tally, name: str, call: Callable[[], requests.Response]) -> requests.Response | None:
    """``tally.send`` that also gives the answer back (None: no answer)."""
    kept: list[requests.Response] = []

    def keep() -> requests.Response:
        kept.append(call())
        return kept[-1]

    tally.send(name, keep)
    return kept[-1] if kept else None


def _honest_pushes(url: str, join: str, adapter: dict[str, Any], pushes: int, attack_started: float) -> dict[str, Any]:
    """``pushes`` 9 MiB updates of one honest worker, one after another: how each went and how long it took."""
    client = CoordinatorClient(url, token=join)
    client.workers.register("honest", EXPERT, expert_spec(rank=64)["base_model"])
    outcomes: Counter[str] = Counter()
    seconds: list[float] = []
    first_applied = None
    version = 0
    for i in range(pushes):
        body = dumps(random_like(adapter, seed=100 + i, scale=1e-3))
        client.updates.last_upload = None
        started = time.monotonic()
        try:
            status = client.updates.push(EXPERT, body, update_meta(base_version=version, worker_id="honest"))
        except FedMoEError as exc:
            outcomes[f"failed: {type(exc).__name__}"] += 1
            continue
        seconds.append(time.monotonic() - started)
        version = int(status.get("expert_version", version))
        outcomes["resumable" if client.updates.last_upload is not None and client.updates.last_upload.chunks else "one request"] += 1
        if first_applied is None and status.get("status") == "applied":
            first_applied = time.monotonic() - attack_started
    return {"pushes": pushes, "bytes": len(body), "outcomes": dict(outcomes),
            "seconds_from_attack_start_to_first_applied": None if first_applied is None else round(first_applied, 2),
            **percentiles(seconds)}


def table_rows(part: dict[str, Any]) -> list[list[Any]]:
    """One row for bench.hostile's table."""
    attack, honest = part["attack"], part["honest"]
    return [["reservation_exhaustion", attack["requests"], attack["status_5xx"], attack["status_507"],
             attack["relay_registration_with_join_token"], attack["disk_bytes"],
             ", ".join(f"{k} {v}" for k, v in sorted(honest["outcomes"].items())), honest["p99_s"],
             honest["seconds_from_attack_start_to_first_applied"]]]


TABLE_HEADERS = ["attack", "requests", "5xx", "507", "relay via join token", "disk bytes", "honest 9 MiB pushes",
                 "honest p99 s", "s to first applied"]


@attacks.attack("reservation_exhaustion", table=lambda part: format_table(TABLE_HEADERS, table_rows(part)),
                tallies=lambda part: [part])
def reservation_attack(directory: Path, s: attacks.Settings) -> dict[str, Any]:
    """Uploads opened by every identity and never sent, then an honest worker's pushes."""
    log.info("reservation exhaustion: uploads opened and never sent, then an honest worker's 9 MiB pushes")
    return reservation_exhaustion(directory, honest_pushes=s.honest_pushes)
