"""A relay app (coordinator/relay) in front of a real root served on a loopback port: bad input and checks."""
from __future__ import annotations

import json
import threading

import pytest
import torch
from werkzeug.serving import make_server

from coordinator.api.app import create_app
from coordinator.config import CoordinatorConfig
from coordinator.relay.api import create_relay_app
from coordinator.relay.forwarder import ForwardPolicy, batch_update_id, combine
from coordinator.relay.config import RelayConfig
from protocol.client import CoordinatorClient
from protocol.integrity import DIGEST_HEADER, digest_header
from protocol.schemas import UPDATE_HEADER
from protocol.tensors import dumps, manifest_of
from tests.helpers import FINGERPRINT, expert_spec, make_adapter, random_like, relay_join_token


@pytest.fixture
def root(tmp_path):
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "root", gateway_interval=0))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    admin = CoordinatorClient(url, token=app.extensions["fedmoe_auth"].admin_token)
    admin.experts.create("e1", make_adapter(), expert_spec())
    yield url, (tmp_path / "root" / "join_token").read_text().strip()
    server.shutdown()
    server.server_close()
    app.extensions["fedmoe"].close()


@pytest.fixture
def relay(root, tmp_path):
    url, join = root
    app = create_relay_app(RelayConfig(upstream=url, join_token=join, relay_id="r1",
                                       relay_join_token=relay_join_token(tmp_path / "root"),
                                       coordinator=CoordinatorConfig(data_dir=tmp_path / "relay"),
                                       forward=ForwardPolicy(interval=3600)))
    app.extensions["fedmoe"].join_upstream()
    yield app, join
    app.extensions["fedmoe"].close()


def register(app, join, worker_id="w1", fingerprint=FINGERPRINT):
    return app.test_client(token=join).post("/api/v1/workers", json={
        "worker_id": worker_id, "specialty": "e1", "base_model": {"id": "m", "fingerprint": fingerprint}})


def push(app, token, body, update_id="u1", expert="e1", **meta):
    meta = {"update_id": update_id, "base_version": 0, "num_samples": 5, **meta}
    return app.test_client(token=token).post(f"/api/v1/experts/{expert}/updates", data=body, headers={
        UPDATE_HEADER: json.dumps(meta), DIGEST_HEADER: digest_header(body)})


def test_workers_of_another_base_model_are_refused_with_409(relay):
    app, join = relay
    r = register(app, join, fingerprint="12" * 32)
    assert r.status_code == 409 and "same --base-model" in r.json["error"]["message"]
    assert register(app, join).status_code == 200


def test_bad_pushes_are_4xx_and_leave_nothing_queued(relay):
    app, join = relay
    token = register(app, join).json["token"]
    good = dumps(random_like(make_adapter(), 1))
    assert push(app, token, good, expert="e2").status_code == 403  # its token is for e1
    nan = random_like(make_adapter(), 2)
    next(iter(nan.values()))[0, 0] = float("nan")
    assert push(app, token, dumps(nan), update_id="nan").status_code in (400, 422)
    wrong_shape = {k: torch.zeros(1) for k in make_adapter()}
    assert push(app, token, dumps(wrong_shape), update_id="shape").status_code in (400, 422)
    bad_digest = app.test_client(token=token).post("/api/v1/experts/e1/updates", data=good, headers={
        UPDATE_HEADER: json.dumps({"update_id": "d", "base_version": 0, "num_samples": 1}),
        DIGEST_HEADER: "sha256=" + "0" * 64})
    assert bad_digest.status_code == 400
    assert app.extensions["fedmoe"].store.stats()["queued_updates"] == 0
    assert push(app, token, good).status_code == 202
    assert push(app, token, good).status_code == 200  # a retry
    other = dumps(random_like(make_adapter(), 3))
    assert push(app, token, other).status_code == 409  # same id, other bytes
    assert app.extensions["fedmoe"].store.stats()["queued_updates"] == 1
    assert app.test_client(token=token).post("/api/v1/forward").status_code == 403  # admin only


def test_combine_is_fedbuffs_staleness_weighted_mean_and_ids_are_deterministic():
    adapter = make_adapter()
    manifest = manifest_of(adapter)
    d1, d2 = random_like(adapter, 1), random_like(adapter, 2)
    metas = [{"num_samples": 10, "base_version": 4}, {"num_samples": 30, "base_version": 2}]
    out = combine(list(zip(metas, [d1, d2])), manifest, version=4, staleness_decay=0.5)
    for k in adapter:  # weights (n_i / N) / (1 + 0.5 * staleness): 0.25 * 1 and 0.75 / 2
        assert torch.allclose(out[k], 0.25 * d1[k] + 0.375 * d2[k])
    assert batch_update_id("r1", "ab12", "e1", 7) == "r1.ab12.e1.7"
    long = batch_update_id("r" * 64, "ab12", "e" * 64, 7)
    assert len(long) <= 128 and long == batch_update_id("r" * 64, "ab12", "e" * 64, 7)


def test_a_relay_with_a_codec_forwards_a_compressed_batch(root, tmp_path):
    """Regression: the forwarder unpacked ErrorFeedback.compress's Compressed as a tuple (TypeError)."""
    url, join = root
    app = create_relay_app(RelayConfig(upstream=url, join_token=join, relay_id="r1",
                                       relay_join_token=relay_join_token(tmp_path / "root"),
                                       coordinator=CoordinatorConfig(data_dir=tmp_path / "relay"),
                                       forward=ForwardPolicy(interval=3600, codec="int8")))
    relay = app.extensions["fedmoe"]
    relay.join_upstream()
    try:
        token = register(app, join).json["token"]
        assert push(app, token, dumps(random_like(make_adapter(), 1))).status_code == 202
        assert relay.forwarder.forward_once() == 1
        assert relay.store.stats()["queued_updates"] == 0
    finally:
        relay.close()


def test_a_relay_keeps_its_worker_rows_with_the_roots_code(relay):
    """Register, renew, heartbeat and list at a relay (coordinator.storage.manifest's worker-row functions on its table)."""
    app, join = relay
    first = register(app, join, "w1")
    assert first.status_code == 200 and first.json["relay"] == "r1"
    admin = app.test_client(token=app.extensions["fedmoe_auth"].admin_token)
    (row,) = admin.get("/api/v1/workers").json["workers"]
    assert row["worker_id"] == "w1" and row["base_model"] == {"id": "m", "fingerprint": FINGERPRINT}
    assert row["status"] == "alive" and row["sync_interval"] is None
    worker = app.test_client(token=first.json["token"])
    hb = worker.post("/api/v1/workers/w1/heartbeat")
    assert hb.status_code == 200 and hb.json == {"worker_id": "w1", "status": "ok"}
    assert error_code(admin.post("/api/v1/workers/nobody/heartbeat")) == (404, "not_found")
    assert worker.post("/api/v1/workers/w2/heartbeat").status_code == 403  # another worker's
    renewed = app.test_client(token=first.json["token"]).post("/api/v1/workers", json={
        "worker_id": "w1", "specialty": "e1", "base_model": {"id": "m", "fingerprint": FINGERPRINT},
        "sync_interval": 30})
    assert renewed.status_code == 200
    (again,) = admin.get("/api/v1/workers").json["workers"]
    assert again["registered_at"] == row["registered_at"] and again["last_seen"] >= row["last_seen"]
    assert again["sync_interval"] == 30


def error_code(response):
    return response.status_code, response.json["error"]["code"]


def test_the_relay_answers_the_upload_probe_itself_for_its_workers(relay):
    """A worker sizes its first auto push from the link to its relay, so the relay reads and drops the probe."""
    app, join = relay
    token = register(app, join).get_json()["token"]
    client = app.test_client(token=token)
    r = client.post("/api/v1/probe", data=bytes(70_000), content_type="application/octet-stream")
    assert r.status_code == 200 and r.get_json() == {"bytes": 70_000}
    assert app.test_client(token=None).post("/api/v1/probe", data=b"x").status_code == 401
    assert client.post("/api/v1/probe", data=bytes((4 << 20) + 1)).status_code == 413


def test_a_stale_pull_gets_the_cached_weights_at_once_and_the_new_version_after_a_background_refresh(root, relay):
    """Stale-while-revalidate: waiting for the refresh made every pull after a new root version wait for the full
    download over the WAN (most of a worker's sync inside a site, docs/wan.md). The forwarder still waits."""
    import time

    url, join = root
    app, _ = relay
    token = register(app, join).get_json()["token"]
    pull = app.test_client(token=token)
    first = pull.get("/api/v1/experts/e1/weights")
    assert first.status_code == 200 and first.headers["X-FedMoE-Version"] == "0"  # nothing cached: waited

    at_root = CoordinatorClient(url, token=join)
    at_root.workers.register("w-root", "e1", {"id": "m", "fingerprint": FINGERPRINT})
    delta = random_like(make_adapter(), seed=5)
    at_root.updates.push("e1", dumps(delta), {"update_id": "root-1", "base_version": 0, "num_samples": 4,
                                             "worker_id": "w-root"})
    assert at_root.experts.get("e1")["version"] == 1
    cache = app.extensions["fedmoe"].cache
    cache.revalidate_seconds = 0.0  # every pull finds the copy stale
    fetched = cache.upstream_fetches
    stale = pull.get("/api/v1/experts/e1/weights")
    assert stale.status_code == 200 and stale.headers["X-FedMoE-Version"] == "0"  # at once, not after the fetch
    deadline = time.monotonic() + 30
    while pull.get("/api/v1/experts/e1/weights").headers["X-FedMoE-Version"] != "1":
        assert time.monotonic() < deadline, "the background refresh never brought version 1"
        time.sleep(0.05)
    assert cache.upstream_fetches == fetched + 1  # one refresh, however many pulls found the copy stale
    assert cache.get("e1", wait=True).version == 1


def test_raw_bodies_are_combined_in_one_pass_per_file_bit_for_bit_as_tensor_by_tensor(tmp_path):
    """The forwarder reads a queued raw body through one open file (FileTensors reopened it for every tensor)."""
    from coordinator.checks.adapters import stored_deltas
    from protocol.streaming import FileTensors, FileTensorsOnce

    adapter = make_adapter()
    manifest = manifest_of(adapter)
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"u{i}.safetensors")
        paths[-1].write_bytes(dumps(random_like(adapter, i)))
    metas = [{"num_samples": n, "base_version": v} for n, v in ((3, 4), (5, 2), (1, 4))]
    once = [stored_deltas(p, "safetensors", {}, manifest) for p in paths]
    assert all(isinstance(d, FileTensorsOnce) for d in once)
    assert dict(once[0].decoded_items()).keys() == adapter.keys()
    fast = combine(list(zip(metas, once)), manifest, version=4, staleness_decay=0.1)
    slow = combine(list(zip(metas, [FileTensors(p) for p in paths])), manifest,
                   version=4, staleness_decay=0.1)
    assert all(torch.equal(fast[k], slow[k]) for k in adapter)
