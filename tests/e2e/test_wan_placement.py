"""A hierarchy that forms itself (issue 35 item 2): three emulated sites, no relay placed by hand.

Each site (a network namespace behind a 20 Mbit/s, 50 ms link to the root, bench.wanemu) runs two real tiny-qwen2
workers, all started with ``--follow-placement`` and the root's URL alone; each site's first worker also has
``--can-relay``. The root must group the workers by site, pick each site's own relay, and the workers must move
there and back out (their relays drain as they stop) with every acknowledged update applied at the root once.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from bench.wanemu import NamespaceUnavailable, WanLink, check_available, list_namespaces
from bench.wanemu.namespaces import PREFIX
from coordinator.api.app import create_app
from coordinator.config import CoordinatorConfig
from tests import launcher
from tests.e2e.conftest import ROOT, env
from tests.helpers import serve_on_loopback

SITES, WORKERS = 3, 2
FORMED_WITHIN_S = 45
"""The stated time: from the moment every worker has joined the root and every relay has registered there, to every
site's workers assigned to that site's relay (each worker reports at its syncs, every ~2-15 s under load; a join,
or a relay a worker reaches for the first time, regroups at once)."""
START_BOUND_S = 600
"""Nine torch processes (six workers, three relays) starting on a loaded 2-core machine: minutes; not a figure."""

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def namespaces():
    try:
        check_available()
    except NamespaceUnavailable as exc:
        pytest.skip(f"WAN emulation needs network namespaces: {exc}")

    def ours() -> set[str]:
        return {n for n in list_namespaces() if n.startswith(f"{PREFIX}{os.getpid()}")}

    yield
    assert not ours(), f"a test left network namespaces behind: {sorted(ours())}"


def worker(site: int, i: int, url: str, tmp_path) -> list[str]:
    argv = [sys.executable, str(ROOT / "run_worker.py"), "--specialty", "sql_expert", "--base-model", "tiny-qwen2",
            "--coordinator-url", url, "--worker-id", f"s{site}-w{i}", "--duration", "900", "--sync-interval", "2",
            "--batch-size", "2", "--max-seq-len", "32", "--threads", "1", "--no-heldout-eval",
            "--state-dir", str(tmp_path / f"s{site}-w{i}"), "--results", str(tmp_path / f"s{site}-w{i}.jsonl"),
            "--speed-factor", "0.05",  # a step, then a 19x longer sleep: six workers cost little CPU
            "--follow-placement", "--placement-interval", "2"]
    return argv + (["--can-relay", "--relay-flags", "--forward-interval 2 --rate-limit 0"] if i == 0 else [])


def records(tmp_path) -> dict[str, list[dict]]:
    out = {}
    for path in tmp_path.glob("s*-w*.jsonl"):
        lines = path.read_text().splitlines()
        out[path.stem] = [json.loads(line) for line in lines[:-1] + [x for x in lines[-1:] if x.endswith("}")]]
    return out


def synced_at_relay(rows: list[dict], relay_id: str) -> bool:
    """A sync after the root assigned this worker to ``relay_id`` (the record of the sync a move follows names it)."""
    assigned = [n for n, r in enumerate(rows) if r.get("placement", {}).get("relay_id") == relay_id]
    return bool(assigned) and any("sync_seconds" in r for r in rows[assigned[0] + 1:])


def wait_for(what: str, condition, timeout: float) -> float:
    """Seconds until ``condition()`` held; fails the test with ``what`` after ``timeout``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"not within {timeout:.0f} s: {what}"
        time.sleep(1)
    return time.monotonic() - started


def test_three_sites_group_themselves_behind_their_own_relays_and_lose_nothing(namespaces, tmp_path):
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "root"))
    server, url = serve_on_loopback(app)
    token = app.extensions["fedmoe_auth"].admin_token
    admin = {"Authorization": f"Bearer {token}"}

    def get(path: str) -> dict:
        return requests.get(f"{url}/api/v1/{path}", headers=admin, timeout=10).json()

    names = [f"s{s}-w{i}" for s in range(SITES) for i in range(WORKERS)]
    expected = [{"members": [f"s{s}-w{i}" for i in range(WORKERS)], "relay_id": f"s{s}-w0-relay"} for s in range(SITES)]
    tokens = {"FEDMOE_JOIN_TOKEN": token, "FEDMOE_RELAY_JOIN_TOKEN": token, "FEDMOE_TOKEN": token,
              "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen] = []
    links = [WanLink(("127.0.0.1", int(url.rsplit(":", 1)[1])), 20.0, 50.0) for _ in range(SITES)]
    try:
        for site, link in enumerate(links):
            for i in range(WORKERS):
                with (tmp_path / f"s{site}-w{i}.log").open("w") as out:
                    procs.append(launcher.popen(link.site.command(worker(site, i, link.url, tmp_path)), cwd=ROOT,
                                                env={**env(), **tokens}, stdout=subprocess.DEVNULL, stderr=out))
        wait_for("every worker joined and every relay registered", lambda: set(names) <= {w["worker_id"] for w in get("workers")["workers"]}
                 and sum(1 for r in get("relays")["relays"] if r.get("url")) == SITES, START_BOUND_S)
        formed = wait_for(f"the plan {expected}", lambda: [{k: g[k] for k in ("members", "relay_id")}
                                                           for g in get("placement")["groups"]] == expected,
                          FORMED_WITHIN_S)
        wait_for("every worker synced at its site's relay", lambda: all(
            synced_at_relay(records(tmp_path).get(n, []), f"{n[:2]}-w0-relay") for n in names), 120)
        for p in procs:  # a graceful stop: the final push, then each --can-relay worker drains its relay
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=300)
        pushed = [r["update_id"] for rows in records(tmp_path).values() for r in rows if r.get("update_id")]
        status = {u: get(f"updates/{u}") for u in pushed}  # asked of the root before it stops
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for link in links:
            link.close()
        server.shutdown()
    logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.log")}
    assert all(p.returncode == 0 for p in procs), logs
    print(f"hierarchy formed {formed:.1f} s after the last worker and relay were up")
    assert len(pushed) >= 2 * len(names)
    assert all(s.get("status") == "applied" for s in status.values()), {u: s for u, s in status.items()
                                                                           if s.get("status") != "applied"}
