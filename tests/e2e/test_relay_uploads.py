"""A resumable push through a real relay (run_coordinator.py --upstream) to a real root, on loopback.

The worker's client (protocol/uploads.py) pushes a 2 MiB update in chunks to the relay through a proxy
that breaks the upload half-way; at the break the relay is killed with SIGKILL and restarted on its data
dir. The client asks the restarted relay where it stands and sends only the rest; the relay queues the
finished upload like a one-shot push, forwards it once, and the root applies it once.
"""
from __future__ import annotations

import pytest
import requests

from bench.wanemu.cut import CutProxy
from protocol.client import CoordinatorClient, RetryPolicy
from protocol.tensors import dumps
from protocol.uploads import UploadPolicy
from tests.e2e.test_relay import BASE, admin, forward_now, start_pair
from tests.helpers import expert_spec, make_adapter, random_like

pytestmark = pytest.mark.e2e

ADAPTER = dict(rank=16, d_in=1024, d_out=1024, layers=8)  # 2 MiB of float32
CHUNK = 128 << 10
FIXED_CHUNKS = UploadPolicy(threshold=1, first_chunk=CHUNK, min_chunk=CHUNK, max_chunk=CHUNK)
HEADERS = 8 << 10  # allowance for the HTTP heads of the few requests around the break


def _address(url: str) -> tuple[str, int]:
    return "127.0.0.1", int(url.rsplit(":", 1)[1])


def _worker_token(relay_url: str, join: str) -> str:
    r = requests.post(f"{relay_url}/api/v1/workers", headers={"Authorization": f"Bearer {join}"}, timeout=60,
                      json={"worker_id": "w0", "specialty": "e1", "base_model": BASE})
    assert r.status_code == 200, r.text
    return r.json()["token"]


def test_an_upload_broken_by_a_relay_crash_resumes_at_the_restarted_relay_and_is_applied_once(tmp_path):
    root, relay = start_pair(tmp_path, "--forward-interval", "3600")
    try:
        adapter = make_adapter(**ADAPTER)
        root_admin = admin(root)
        root_admin.experts.create("e1", adapter, expert_spec(rank=16))
        delta = random_like(adapter, seed=3, scale=0.01)
        body = dumps(delta)
        meta = {"update_id": "w0-big-1", "base_version": 0, "num_samples": 9, "worker_id": "w0"}
        token = _worker_token(relay.url, (tmp_path / "join").read_text().strip())
        cut_at = len(body) // 2
        proxy = CutProxy(_address(relay.url), cut_at=cut_at)

        def crash_and_restart() -> None:
            relay.kill()
            relay.start()
            proxy.retarget(_address(relay.url))

        proxy.on_cut = crash_and_restart
        with proxy:
            client = CoordinatorClient(proxy.url(), token=token, upload=FIXED_CHUNKS,
                                       retry=RetryPolicy(attempts=4, base_delay=0.05))
            status = client.updates.push("e1", body, meta)
        assert proxy.cuts == 1 and client.updates.last_upload.resumes == 1
        assert status["status"] == "queued" and status["relay"] == "site-a"
        # the chunks acknowledged before the crash were kept: at most one chunk was sent again
        assert client.updates.last_upload.resent <= CHUNK
        assert proxy.bytes_after_cut <= len(body) - cut_at + CHUNK + HEADERS

        assert forward_now(relay)["delivered"] == 1
        again = CoordinatorClient(relay.url, token=token).updates.push("e1", body, meta)  # one-shot, same id
        assert again["update_id"] == meta["update_id"] and again["status"] == "forwarded"
        assert forward_now(relay)["delivered"] == 0
        info = root_admin.experts.get("e1")
        assert (info["version"], info["updates_applied"], info["samples_seen"]) == (1, 1, 9)
        weights = root_admin.experts.pull("e1").tensors
        for k in adapter:  # fedasync, lr 1, no staleness decay, lossless forwarding: w0 + delta, once
            assert (weights[k] - (adapter[k] + delta[k])).abs().max() < 1e-6, k
        assert root_admin.updates.status(meta["update_id"])["relayed_in"].startswith("site-a.")
        assert not list((tmp_path / "relay" / "uploads").glob("*.part"))
    finally:
        relay.stop()
        root.stop()
