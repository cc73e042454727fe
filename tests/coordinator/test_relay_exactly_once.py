"""Exactly once across relays and fail-over: the root records a batch's member update ids with it.

A worker whose 202 was lost fails over and pushes the same update id again, to another relay or to
the root. Two real relay apps forward over HTTP to a real root on a loopback port; the root's
weights and counters must show every update once, and the relays' error-feedback residuals must
not keep a share of an update the root received another way.
"""
from __future__ import annotations

import contextlib
import json
import threading

import pytest
import torch
from werkzeug.serving import make_server

from coordinator.api.app import create_app
from coordinator.config import CoordinatorConfig
from coordinator.relay.api import create_relay_app
from coordinator.relay.forwarder import ForwardPolicy
from coordinator.relay.config import RelayConfig
from coordinator.relay.relay_store import RelayStore
from protocol.client import CoordinatorClient
from protocol.integrity import DIGEST_HEADER, digest_header
from protocol.schemas import MAX_BATCH_MEMBERS, UPDATE_HEADER
from protocol.tensors import dumps, loads
from tests.helpers import FINGERPRINT, expert_spec, make_adapter, random_like, relay_join_token

BASE = {"id": "m", "fingerprint": FINGERPRINT}


@contextlib.contextmanager
def root_on_loopback(tmp_path):
    """A root applying each update in full (fedasync, lr 1, no staleness decay): weights = w0 + sum of deltas.
    Yields (app, url, admin client, join token)."""
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "root", gateway_interval=0, staleness_decay=0.0,
                                     async_alpha=1.0))  # each update whole: exactly once, not how relays count
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    admin = CoordinatorClient(url, token=app.extensions["fedmoe_auth"].admin_token)
    try:
        admin.experts.create("e1", make_adapter(), expert_spec())
        yield app, url, admin, (tmp_path / "root" / "join_token").read_text().strip()
    finally:
        server.shutdown()
        server.server_close()
        app.extensions["fedmoe"].close()


@pytest.fixture
def root(tmp_path):
    with root_on_loopback(tmp_path) as served:
        yield served


def make_relay(root, tmp_path, relay_id, codec="safetensors", codec_config=None, **config):
    """A relay app joined to ``root``, forwarding only when told (``forwarder.forward_once()``); ``config``:
    more RelayConfig fields. The same relay_id again is a restart on the same data dir."""
    _, url, _, join = root
    app = create_relay_app(RelayConfig(upstream=url, join_token=join, relay_id=relay_id,
                                       relay_join_token=relay_join_token(tmp_path / "root"),
                                       coordinator=CoordinatorConfig(data_dir=tmp_path / relay_id),
                                       forward=ForwardPolicy(interval=3600, codec=codec, codec_config=codec_config,
                                                             staleness_decay=0.0), **config))
    app.extensions["fedmoe"].join_upstream()
    return app


@pytest.fixture
def relays(root, tmp_path):
    apps = [make_relay(root, tmp_path, "r1"), make_relay(root, tmp_path, "r2")]
    yield apps
    for app in apps:
        app.extensions["fedmoe"].close()


def token_at(app, join, worker_id):
    r = app.test_client(token=join).post("/api/v1/workers", json={
        "worker_id": worker_id, "specialty": "e1", "base_model": BASE})
    assert r.status_code == 200, r.json
    return r.json["token"]


def push(app, token, delta, update_id, samples, worker_id):
    body = dumps(delta)
    meta = {"update_id": update_id, "base_version": 0, "num_samples": samples, "worker_id": worker_id}
    return app.test_client(token=token).post("/api/v1/experts/e1/updates", data=body, headers={
        UPDATE_HEADER: json.dumps(meta), DIGEST_HEADER: digest_header(body)})


def root_weights(admin):
    return admin.experts.pull("e1").tensors


def test_an_update_pushed_to_two_relays_and_the_root_is_applied_once(root, relays):
    root_app, _, admin, join = root
    r1, r2 = relays
    w0 = root_weights(admin)
    adapter = make_adapter()
    d_u, d_v, d_w = (random_like(adapter, s) for s in (1, 2, 3))
    a = {app: token_at(app, join, "wa") for app in (root_app, r1, r2)}
    b = token_at(r2, join, "wb")

    # W reaches the root directly first (its worker had failed over to the root), then r1 too
    assert push(root_app, a[root_app], d_w, "W", 3, "wa").status_code == 202
    # U's 202 from r1 "was lost": the worker pushed it again at r2; V is another worker's, at r2
    assert push(r1, a[r1], d_u, "U", 5, "wa").status_code == 202
    assert push(r1, a[r1], d_w, "W", 3, "wa").status_code == 202
    assert push(r2, a[r2], d_u, "U", 5, "wa").status_code == 202
    assert push(r2, b, d_v, "V", 7, "wb").status_code == 202

    # r1's batch {U, W} is refused for W; r1 re-sends {U} alone under a new id
    assert r1.extensions["fedmoe"].forwarder.forward_once() == 1
    # r2's batch {U, V} is refused for U (now inside r1's batch); r2 re-sends {V}
    assert r2.extensions["fedmoe"].forwarder.forward_once() == 1
    # U pushed directly too: a duplicate, answered with the status of the batch that carried it
    again = push(root_app, a[root_app], d_u, "U", 5, "wa")
    assert again.status_code == 200 and again.json["status"] == "applied"
    assert again.json["relayed_in"].startswith("r1.")
    assert push(root_app, a[root_app], d_v, "U", 5, "wa").status_code == 409  # same id, other bytes

    info = admin.experts.get("e1")
    assert info["samples_seen"] == 3 + 5 + 7 and info["updates_applied"] == 3
    got = root_weights(admin)
    for k in w0:
        assert torch.allclose(got[k], w0[k] + d_u[k] + d_v[k] + d_w[k], atol=1e-6), k

    s1, s2 = r1.extensions["fedmoe"], r2.extensions["fedmoe"]
    assert s1.update_status("W")["status"] == "applied_elsewhere"
    assert s1.update_status("U")["status"] == "forwarded"
    assert s2.update_status("U")["status"] == "applied_elsewhere"
    assert s2.update_status("V")["status"] == "forwarded"
    assert s1.store.stats()["updates_forwarded"] == 1 and s2.store.stats()["updates_forwarded"] == 1
    assert s1.store.queued_bytes() == 0 and s2.store.queued_bytes() == 0
    assert set(s1.blobs.digests()) == s1.store.referenced_blobs()  # nothing dropped batch left behind


def test_a_batch_whose_members_all_reached_the_root_is_dropped_whole(root, relays):
    root_app, _, admin, join = root
    r1 = relays[0]
    d = random_like(make_adapter(), 4)
    assert push(root_app, token_at(root_app, join, "wa"), d, "U", 5, "wa").status_code == 202
    assert push(r1, token_at(r1, join, "wa"), d, "U", 5, "wa").status_code == 202
    assert r1.extensions["fedmoe"].forwarder.forward_once() == 0
    assert admin.experts.get("e1")["samples_seen"] == 5
    assert r1.extensions["fedmoe"].store.experts_with_work() == []


def test_a_superseded_batch_gives_back_the_residual_it_was_encoded_on(root, tmp_path):
    """With error feedback, what the root applied plus the relay's residual is every delta that went through
    this relay, exactly: the dropped member's share of the refused batch is in neither."""
    root_app, _, admin, join = root
    relay = make_relay(root, tmp_path, "r1", codec="topk", codec_config={"ratio": 0.2})
    try:
        adapter = make_adapter()
        d1, d2, d3 = (random_like(adapter, s) for s in (5, 6, 7))
        w0 = root_weights(admin)
        token = token_at(relay, join, "wa")
        assert push(relay, token, d1, "U1", 4, "wa").status_code == 202
        assert relay.extensions["fedmoe"].forwarder.forward_once() == 1  # leaves a residual
        assert push(root_app, token_at(root_app, join, "wa"), d2, "U2", 4, "wa").status_code == 202
        assert push(relay, token, d2, "U2", 4, "wa").status_code == 202
        assert push(relay, token, d3, "U3", 4, "wa").status_code == 202
        assert relay.extensions["fedmoe"].forwarder.forward_once() == 1  # {U2, U3} refused, {U3} sent
        store = relay.extensions["fedmoe"].store
        residual = loads(relay.extensions["fedmoe"].blobs.path(store.residual("e1")).read_bytes())
        got = root_weights(admin)
        for k in w0:
            through_relay = got[k] - w0[k] - d2[k] + residual[k]
            assert torch.allclose(through_relay, d1[k] + d3[k], atol=1e-5), k
        assert admin.experts.get("e1")["samples_seen"] == 12
    finally:
        relay.extensions["fedmoe"].close()


def test_only_a_relay_names_members_and_the_root_checks_them(root):
    root_app, _, _, join = root
    token = token_at(root_app, join, "wa")
    body = dumps(random_like(make_adapter(), 1))
    digest = "b3-" + "0" * 64

    def post(tok, members):
        meta = {"update_id": "B1", "base_version": 0, "num_samples": 1, "members": members}
        return root_app.test_client(token=tok).post("/api/v1/experts/e1/updates", data=body, headers={
            UPDATE_HEADER: json.dumps(meta), DIGEST_HEADER: digest_header(body)})

    refused = post(token, {"x1": digest})  # a worker claiming other updates' ids
    assert refused.status_code == 403 and "members" in refused.json["error"]["message"]
    admin_token = root_app.extensions["fedmoe_auth"].admin_token
    for bad in ([], {}, {"B1": digest}, {"bad id!": digest}, {"x1": "nothex"},
                {f"m{i}": digest for i in range(MAX_BATCH_MEMBERS + 1)}):
        r = post(admin_token, bad)
        assert r.status_code == 400, (bad if len(str(bad)) < 200 else "too many", r.json)
    assert post(admin_token, {"x1": digest}).status_code == 202


def test_pruning_keeps_the_relay_store_bounded_and_a_restart_never_reuses_a_batch_id(root, tmp_path):
    _, _, admin, join = root
    relay = make_relay(root, tmp_path, "r1")
    service = relay.extensions["fedmoe"]
    service.store.keep_forwarded = 3
    token = token_at(relay, join, "wa")
    adapter = make_adapter()
    counts = []
    try:
        for i in range(8):
            assert push(relay, token, random_like(adapter, 10 + i), f"U{i}", 2, "wa").status_code == 202
            assert service.forwarder.forward_once() == 1
            counts.append(service.store.row_counts())
        stats = service.store.stats()
    finally:
        service.close()
    assert counts[-1] == {"updates": 3, "batches": 3}  # not 8 and 8
    assert max(c["updates"] for c in counts) <= 3 and max(c["batches"] for c in counts) <= 4
    assert stats["updates_received"] == 8 and stats["updates_forwarded"] == 8 and stats["batches_forwarded"] == 8
    # a pruned update pushed again is queued, but the root knows it: dropped, not applied twice
    again = make_relay(root, tmp_path, "r1")
    try:
        service = again.extensions["fedmoe"]
        assert push(again, token, random_like(adapter, 10), "U0", 2, "wa").status_code == 202
        assert service.forwarder.forward_once() == 0
        assert service.update_status("U0")["status"] == "applied_elsewhere"
        assert push(again, token, random_like(adapter, 99), "U8", 2, "wa").status_code == 202
        assert service.forwarder.forward_once() == 1  # a new id after the restart: r1.<epoch>.e1.10
        assert service.update_status("U8")["forwarded_as"].endswith(".e1.10")
    finally:
        service.close()
    assert admin.experts.get("e1")["samples_seen"] == 9 * 2


def test_a_relay_store_from_before_prev_residual_opens(tmp_path):
    import sqlite3

    path = tmp_path / "relay.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE batches (expert TEXT NOT NULL, seq INTEGER NOT NULL, update_id TEXT NOT NULL UNIQUE, "
               "meta TEXT NOT NULL, blob TEXT, size INTEGER NOT NULL, members INTEGER NOT NULL, "
               "member_bytes INTEGER NOT NULL, status TEXT NOT NULL, created_at REAL NOT NULL, "
               "PRIMARY KEY (expert, seq))")
    db.execute("INSERT INTO batches VALUES ('e1', 4, 'r.x.e1.4', '{}', NULL, 1, 1, 1, 'forwarded', 0)")
    db.commit()
    db.close()
    store = RelayStore(path)
    try:
        assert store.next_seq("e1") == 5 and store.referenced_blobs() == set()
    finally:
        store.close()


def test_a_refused_batch_costs_the_root_no_aggregation_step_and_records_nothing(root):
    """The members check comes before the norm check and the step a batch would complete: a 409 decodes and
    aggregates nothing, and leaves no update row, norm or version behind."""
    root_app, _, admin, join = root
    c = root_app.extensions["fedmoe"]
    assert push(root_app, token_at(root_app, join, "wa"), random_like(make_adapter(), 1), "U", 5, "wa").status_code == 202
    prepared = []
    real_prepare = c.steps.prepare
    c.steps.prepare = lambda *args: prepared.append(args[1]["update_id"]) or real_prepare(*args)
    norms, last_event = c.store.rows.recent_norms("e1", 100), c.events(1)[0]["id"]
    body = dumps(random_like(make_adapter(), 2))
    admin_token = root_app.extensions["fedmoe_auth"].admin_token

    def batch(update_id, members):
        meta = {"update_id": update_id, "base_version": 1, "num_samples": 4, "members": members}
        return root_app.test_client(token=admin_token).post("/api/v1/experts/e1/updates", data=body, headers={
            UPDATE_HEADER: json.dumps(meta), DIGEST_HEADER: digest_header(body)})

    refused = batch("r1.x.e1.1", {"U": "b3-" + "1" * 64, "V": "b3-" + "2" * 64})
    assert refused.status_code == 409 and refused.json["error"]["details"]["members"] == ["U"]
    assert prepared == []  # the step it would have completed (fedasync: every update) was never computed
    assert c.store.rows.update("r1.x.e1.1") is None and c.store.rows.update("V") is None
    assert c.store.rows.recent_norms("e1", 100) == norms
    info = admin.experts.get("e1")
    assert (info["version"], info["updates_applied"], info["samples_seen"]) == (1, 1, 5)
    assert [e["kind"] for e in c.events(100, after=last_event)] == ["update_rejected"]  # only the audit row
    assert batch("r1.x.e1.2", {"V": "b3-" + "2" * 64}).status_code == 202  # the rest, re-sent: applied
    assert prepared == ["r1.x.e1.2"] and admin.experts.get("e1")["version"] == 2
    assert batch("r1.x.e1.2", {"V": "b3-" + "2" * 64}).status_code == 200  # its retry: not refused for its own members
