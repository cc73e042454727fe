"""A real relay (run_coordinator.py --upstream) between clients and a real root, on loopback.

Checks: one combined update per expert per interval (FedBuff's sample-weighted mean, exactly),
retries applied once, pulls served from the relay's cache, the tree at the root, a root of another
base model refused at start with one line, an unreachable root (queue, 507 when full, forward
later), and kill -9 of the relay at random moments (bench/relay_crash.py).
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from bench.common import CoordinatorProcess
from bench.relay_crash import free_port
from bench.relay_crash import run as crash_run
from protocol.client import CoordinatorClient, RetryPolicy
from protocol.errors import Unavailable
from privacy.dp import update_norm
from protocol.tensors import dumps
from tests import launcher
from tests.e2e.conftest import ROOT, env
from tests.e2e.test_wan import namespaces  # noqa: F401 - the fixture: skips where namespaces are not permitted
from tests.helpers import FINGERPRINT, expert_spec, make_adapter, random_like

pytestmark = pytest.mark.e2e
BASE = expert_spec()["base_model"]


def start_pair(tmp_path: Path, *relay_flags: str, root_flags: tuple[str, ...] = ()) -> tuple[CoordinatorProcess,
                                                                                           CoordinatorProcess]:
    root = CoordinatorProcess(tmp_path / "root", "--staleness-decay", "0", *root_flags)
    root.start()
    (tmp_path / "join").write_text((tmp_path / "root" / "join_token").read_text())
    relay = CoordinatorProcess(tmp_path / "relay", "--upstream", root.url, "--join-token-file", str(tmp_path / "join"),
                               "--relay-join-token-file", str(tmp_path / "root" / "relay_join_token"),
                               "--relay-id", "site-a", "--staleness-decay", "0", *relay_flags)
    try:
        relay.start()
    except BaseException:
        root.stop()
        raise
    return root, relay


def worker_client(url: str, tmp_path: Path, worker_id: str, attempts: int = 3) -> CoordinatorClient:
    client = CoordinatorClient(url, token=(tmp_path / "join").read_text().strip(),
                               retry=RetryPolicy(attempts=attempts, base_delay=0.1, max_delay=0.5))
    client.workers.register(worker_id, "e1", BASE)
    return client


def admin(root: CoordinatorProcess) -> CoordinatorClient:
    return CoordinatorClient(root.url, token=(root.data_dir / "admin_token").read_text().strip())


def forward_now(relay: CoordinatorProcess) -> dict:
    """The relay's admin route that runs one forwarding cycle now (the tests use a long --forward-interval)."""
    r = requests.post(f"{relay.url}/api/v1/forward", headers=relay.headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


def test_relay_forwards_one_sample_weighted_mean_and_serves_pulls_from_its_cache(tmp_path):
    root, relay = start_pair(tmp_path, "--forward-interval", "3600", "--advertise-url", "http://127.0.0.1:9",
                             "--forward-on-exit")
    try:
        adapter = make_adapter()
        clients = [worker_client(relay.url, tmp_path, f"w{i}") for i in range(3)]
        assert clients[0].experts.create("e1", adapter, expert_spec())["version"] == 0
        for c in clients[1:]:  # answered from the relay's cache: the adapter does not go upstream again
            assert c.experts.create("e1", adapter, expert_spec())["version"] == 0
        deltas, samples = [random_like(adapter, i) for i in range(3)], [10, 20, 30]
        for i, c in enumerate(clients):
            meta = {"update_id": f"u{i}", "base_version": 0, "num_samples": samples[i], "worker_id": f"w{i}"}
            assert c.updates.push("e1", dumps(deltas[i]), meta)["status"] == "queued"
        retry = clients[0].updates.push("e1", dumps(deltas[0]), {"update_id": "u0", "base_version": 0,
                                                                "num_samples": 10, "worker_id": "w0"})
        assert retry["update_id"] == "u0"
        assert forward_now(relay)["delivered"] == 1
        root_admin = admin(root)
        expert = root_admin.experts.get("e1")
        assert expert["samples_seen"] == 60 and expert["updates_applied"] == 1  # one combined update for three
        weights = root_admin.experts.pull("e1").tensors
        for k in adapter:  # FedBuff's sample-weighted mean, applied once by the root (fedasync, lr 1)
            expected = adapter[k] + sum(n / 60 * d[k] for n, d in zip(samples, deltas))
            assert (weights[k] - expected).abs().max() < 1e-6
        # the relay revalidates its cache upstream at most once a second: version 1 shows up then
        pulled = wait_for(lambda: (p := clients[1].experts.pull("e1", worker_id="w1")).version == 1 and p)
        assert all((pulled.tensors[k] == weights[k]).all() for k in weights)
        assert clients[2].experts.pull("e1", etag=pulled.etag, worker_id="w2").tensors is None  # 304
        status = clients[0].updates.status("u0")
        assert status["status"] == "forwarded" and status["forwarded_as"].startswith("site-a.")
        assert forward_now(relay)["delivered"] == 0  # nothing queued; the cycle reports to the root
        (site,) = requests.get(f"{root.url}/api/v1/relays", headers=root.headers, timeout=10).json()["relays"]
        assert site["relay_id"] == "site-a" and site["url"] == "http://127.0.0.1:9"
        assert sorted(w["worker_id"] for w in site["workers"]) == ["w0", "w1", "w2"]
        assert site["stats"]["updates_forwarded"] == 3 and site["stats"]["batches_forwarded"] == 1
        assert site["stats"]["bytes_served"] > 0 and site["bytes_saved"] > 0
        # --forward-on-exit (what run_worker.py --can-relay starts its relay with): an update acknowledged after the
        # last forward goes upstream when the relay is stopped, instead of waiting in its data dir for a restart
        meta = {"update_id": "u-late", "base_version": 1, "num_samples": 5, "worker_id": "w1"}
        assert clients[1].updates.push("e1", dumps(deltas[1]), meta)["status"] == "queued"
        relay.stop(timeout=120)
        assert relay.proc.returncode == 0
        assert root_admin.experts.get("e1")["samples_seen"] == 65 and root_admin.experts.get("e1")["updates_applied"] == 2
    finally:
        relay.stop()
        root.stop()


def test_an_unknown_transfer_encoding_is_a_400_then_close_at_the_root_and_at_the_relay(tmp_path):
    root, relay = start_pair(tmp_path, "--forward-interval", "3600")
    try:
        for server in (root, relay):
            parts = urlsplit(server.url)
            with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
                sock.sendall(b"POST /api/v1/probe HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer "
                             + (tmp_path / "join").read_text().strip().encode()
                             + b"\r\nTransfer-Encoding: chunked, gzip\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
                answer = b""
                while piece := sock.recv(65536):  # the server closes: the body's framing is unknown
                    answer += piece
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 ") and b"Connection: close" in head, (server.url, head)
            error = json.loads(body)["error"]
            assert error["code"] == "bad_request" and error["details"]["reason"] == "unsupported_transfer_encoding"
            assert "'chunked, gzip'" in error["message"]
    finally:
        relay.stop()
        root.stop()


def test_a_relay_with_tls_answers_https_and_tells_a_plain_http_client_to_use_it(tmp_path):
    """--tls-cert/--tls-key on a relay (issue 30, 3): it served plain HTTP, silently, since only the root's serve
    function wired TLS. A worker reaches it over https (its body spooled and forwarded to the plain root)."""
    from protocol.errors import TLSFailure
    from tests.e2e.test_security import self_signed

    cert, key = self_signed(tmp_path)
    root, relay = start_pair(tmp_path, "--forward-interval", "3600", "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        assert relay.url.startswith("https://")  # the relay says what it serves
        worker = CoordinatorClient(relay.url, ca_cert=cert, token=(tmp_path / "join").read_text().strip())
        worker.workers.register("w0", "e1", BASE)
        assert worker.health()["role"] == "relay"
        assert worker.experts.create("e1", make_adapter(), expert_spec())["version"] == 0
        with pytest.raises(TLSFailure, match=f"speaks TLS.*use {relay.url}"):
            CoordinatorClient(relay.url.replace("https://", "http://"),
                              retry=RetryPolicy(attempts=3, base_delay=5.0)).health()
    finally:
        relay.stop()
        root.stop()


def test_a_root_of_another_base_model_stops_the_relay_with_one_line(tmp_path):
    root = CoordinatorProcess(tmp_path / "root")
    root.start()
    try:
        admin(root).experts.create("e1", make_adapter(), expert_spec())
        join = tmp_path / "join"
        join.write_text((tmp_path / "root" / "join_token").read_text())
        done = launcher.run(
            [sys.executable, str(ROOT / "run_coordinator.py"), "--port", "0", "--host", "127.0.0.1", "--data-dir",
             str(tmp_path / "relay"), "--upstream", root.url, "--join-token-file", str(join),
             "--relay-join-token-file", str(tmp_path / "root" / "relay_join_token"),
             "--base-model-fingerprint", "12" * 32], env=env(), capture_output=True, text=True, timeout=120)
    finally:
        root.stop()
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "base model" in lines[0] and "e1" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert FINGERPRINT[:12] in lines[0]


def test_an_unreachable_root_queues_answers_507_when_full_and_forwards_later(tmp_path):
    port = free_port()
    root, relay = start_pair(tmp_path, "--forward-interval", "3600", "--max-queue-mb", "0.004",
                             root_flags=("--port", str(port)))
    try:
        adapter = make_adapter()
        client = worker_client(relay.url, tmp_path, "w0", attempts=1)
        client.experts.create("e1", adapter, expert_spec())
        client.experts.pull("e1", worker_id="w0")  # the relay caches version 0
        root.stop()
        acked, n = 0, 0
        with pytest.raises(Unavailable, match="HTTP 507"):  # the client retries a 507 like any 5xx
            while n < 20:  # each update is ~1.3 KB: the fourth does not fit in 4 KiB
                n += 1
                client.updates.push("e1", dumps(random_like(adapter, n)), {"update_id": f"u{n}", "base_version": 0,
                                                                            "num_samples": n, "worker_id": "w0"})
                acked += n
        assert 0 < acked and n <= 4
        down = forward_now(relay)  # builds the batch, cannot send it: it stays recorded
        assert down["delivered"] == 0 and down["upstream_reachable"] is False and down["queued_bytes"] > 0
        assert requests.get(f"{relay.url}/api/v1/health", timeout=10).json()["upstream_reachable"] is False
        assert client.experts.pull("e1", worker_id="w0").version == 0  # served from the cache meanwhile
        root.start()  # the same port and data dir
        assert forward_now(relay)["delivered"] == 1
        expert = admin(root).experts.get("e1")
        assert expert["samples_seen"] == acked and expert["updates_applied"] == 1
    finally:
        relay.stop()
        root.stop()


@pytest.mark.slow  # ~45 s: three restarts of a real relay
def test_kill_9_of_the_relay_loses_no_acknowledged_update_and_applies_none_twice(tmp_path):
    report = crash_run(kills=3, clients=3, seed=1, max_uptime=0.8, work_dir=tmp_path)
    assert report["server_errors"] == []
    assert report["pushes_acknowledged"] > 0
    assert report["root_samples_seen"] == report["samples_acknowledged"]


def test_kill_9_of_a_site_model_relay_loses_nothing_either(tmp_path):
    """The site model is rebuilt from the queue after each restart; what is forwarded is still the durable queue."""
    report = crash_run(kills=3, clients=3, seed=2, max_uptime=0.8, work_dir=tmp_path, site_model=True)
    assert report["server_errors"] == []
    assert report["pushes_acknowledged"] > 0 and report["pulls_answered"] > 0
    assert report["root_samples_seen"] == report["samples_acknowledged"]


PUSH_THROUGH_RELAY = """
import json, sys
from protocol.client import CoordinatorClient
from protocol.tensors import dumps
from tests.helpers import expert_spec, make_adapter, random_like
url, token = sys.argv[1], sys.argv[2]
adapter, pushed, samples = make_adapter(rank=8, d_in=256, d_out=256), 0, 0
for w in range(3):
    c = CoordinatorClient(url, token=token)
    c.workers.register(f"site-w{w}", "e1", expert_spec()["base_model"])
    c.experts.create("e1", adapter, expert_spec(rank=8))
    for n in range(2):
        body = dumps(random_like(adapter, 10 * w + n))
        c.updates.push("e1", body, {"update_id": f"w{w}-{n}", "base_version": 0, "num_samples": 1 + w + 3 * n,
                                   "worker_id": f"site-w{w}"})
        pushed, samples = pushed + len(body), samples + 1 + w + 3 * n
print(json.dumps({"pushed": pushed, "samples": samples}))
"""


@pytest.mark.usefixtures("namespaces")
def test_a_relay_inside_an_emulated_site_sends_less_over_the_wan(tmp_path):
    """One namespace (a site behind 20 Mbit/s, 50 ms RTT) with a relay inside; three workers push through it."""
    import json

    from bench.wanemu import WanLink
    from tests.e2e.test_wan import WAN_MBIT, WAN_RTT_MS

    root = CoordinatorProcess(tmp_path / "root", "--staleness-decay", "0")
    root.start()
    relay_proc = None
    try:
        admin(root).experts.create("e1", make_adapter(rank=8, d_in=256, d_out=256), expert_spec(rank=8))
        join = (tmp_path / "root" / "join_token").read_text().strip()
        (tmp_path / "join").write_text(join)
        with WanLink(("127.0.0.1", int(root.url.rsplit(":", 1)[1])), WAN_MBIT, WAN_RTT_MS) as link:
            relay_proc = link.site.popen(
                [sys.executable, str(ROOT / "run_coordinator.py"), "--host", "127.0.0.1", "--port", "0",
                 "--data-dir", str(tmp_path / "relay"), "--upstream", link.url, "--join-token-file",
                 str(tmp_path / "join"), "--relay-join-token-file", str(tmp_path / "root" / "relay_join_token"),
                 "--forward-interval", "3", "--relay-id", "site-a"],
                cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            relay_url = next(line.split("listening on ", 1)[1].split()[0] for line in relay_proc.stdout
                             if "listening on " in line)
            out = subprocess.run(link.site.command([sys.executable, "-c", PUSH_THROUGH_RELAY, relay_url, join]),
                                 capture_output=True, text=True, timeout=300, cwd=ROOT, env=env())
            assert out.returncode == 0, out.stderr
            sent = json.loads(out.stdout.strip().splitlines()[-1])
            wait_for(lambda: admin(root).experts.get("e1")["samples_seen"] == sent["samples"])
            ingress = link.proxy.bytes_to_target
        assert ingress < sent["pushed"] / 2  # 6 pushes crossed the WAN as at most a few combined updates
    finally:
        if relay_proc is not None:
            relay_proc.kill()
            relay_proc.wait()
        root.stop()


def test_one_update_id_pushed_to_two_relays_and_the_root_is_applied_once(tmp_path):
    """A worker whose 202s were lost failed over twice: the same update reached relay a, relay b and the root.
    The root recorded it directly; each relay's batch naming it is refused (409 with the id), the relay drops it
    and re-sends the rest, so the root's expert shows it once, in samples and in the weights."""
    # --async-alpha 1: each update whole (this is about exactly once; how relays count in alpha: test_async_alpha.py)
    root, relay_a = start_pair(tmp_path, "--forward-interval", "3600", root_flags=("--async-alpha", "1"))
    relay_b = CoordinatorProcess(tmp_path / "relay-b", "--upstream", root.url, "--join-token-file",
                                 str(tmp_path / "join"), "--relay-join-token-file",
                                 str(tmp_path / "root" / "relay_join_token"), "--relay-id", "site-b",
                                 "--staleness-decay", "0",
                                 "--forward-interval", "3600")
    try:
        relay_b.start()
        adapter = make_adapter()
        direct, via_a, via_b = (worker_client(c.url, tmp_path, "w0") for c in (root, relay_a, relay_b))
        direct.experts.create("e1", adapter, expert_spec())
        other = worker_client(relay_b.url, tmp_path, "w1")
        d_u, d_v = random_like(adapter, 1), random_like(adapter, 2)
        meta_u = {"update_id": "w0-u1", "base_version": 0, "num_samples": 5, "worker_id": "w0"}
        for client in (via_a, via_b, direct):
            client.updates.push("e1", dumps(d_u), meta_u)
        other.updates.push("e1", dumps(d_v), {"update_id": "w1-v1", "base_version": 0, "num_samples": 7,
                                             "worker_id": "w1"})
        assert forward_now(relay_a)["delivered"] == 0  # its only member is at the root already
        assert forward_now(relay_b)["delivered"] == 1  # {u1, v1} refused for u1; {v1} sent
        assert via_a.updates.status("w0-u1")["status"] == "applied_elsewhere"
        assert via_b.updates.status("w0-u1")["status"] == "applied_elsewhere"
        assert via_b.updates.status("w1-v1")["status"] == "forwarded"
        root_admin = admin(root)
        expert = root_admin.experts.get("e1")
        assert expert["samples_seen"] == 5 + 7 and expert["updates_applied"] == 2
        weights = root_admin.experts.pull("e1").tensors
        for k in adapter:  # fedasync, lr 1, no staleness decay: each delta added once
            assert (weights[k] - (adapter[k] + d_u[k] + d_v[k])).abs().max() < 1e-6, k
        assert direct.updates.status("w1-v1")["status"] == "applied"  # the root knows relayed members by id
    finally:
        relay_b.stop()
        relay_a.stop()
        root.stop()


def test_a_dp_root_gets_each_workers_update_from_its_relay_and_clips_it_as_that_workers(tmp_path):
    """--dp-noise at the root (noise far below the tolerance, so the clipping shows): the relay learns it when it
    joins and forwards one worker's update per batch, lossless, naming the worker; the root's fedbuff step is
    (clip(d0, C) + d1) / K exactly, where a combined batch would have been refused (409 dp_relay_batch)."""
    root, relay = start_pair(tmp_path, "--forward-interval", "3600", "--forward-compression", "int8",
                             root_flags=("--aggregation", "fedbuff", "--buffer-size", "2", "--dp-noise", "1e-9",
                                         "--dp-clip", "0.5"))
    try:
        adapter = make_adapter()
        clients = [worker_client(relay.url, tmp_path, f"w{i}") for i in range(2)]
        clients[0].experts.create("e1", adapter, expert_spec())
        big, small = random_like(adapter, 1), random_like(adapter, 2, scale=0.001)
        assert update_norm(big) > 0.5 > update_norm(small)
        for i, (c, delta) in enumerate(zip(clients, (big, small))):
            meta = {"update_id": f"u{i}", "base_version": 0, "num_samples": 10 * (i + 1), "worker_id": f"w{i}"}
            assert c.updates.push("e1", dumps(delta), meta)["status"] == "queued"
        assert forward_now(relay)["delivered"] == 2  # one batch per worker
        root_admin = admin(root)
        expert = root_admin.experts.get("e1")
        assert expert["version"] == 1 and expert["privacy"]["dp_fedavg"]["steps"] == 1
        weights = root_admin.experts.pull("e1").tensors
        scale = 0.5 / update_norm(big)
        for k in adapter:  # equal weights over K = 2, whatever the sample counts; no int8 rounding on the way
            assert (weights[k] - (adapter[k] + (scale * big[k] + small[k]) / 2)).abs().max() < 1e-5
        (site,) = requests.get(f"{root.url}/api/v1/relays", headers=root.headers, timeout=10).json()["relays"]
        assert site["stats"]["updates_forwarded"] == 2 and site["stats"]["batches_forwarded"] == 2
    finally:
        relay.stop()
        root.stop()
