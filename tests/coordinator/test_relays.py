"""The root's side of relays: the relay token role, registration checks, reports and the tree."""
from __future__ import annotations

import json

from tests.helpers import FINGERPRINT, make_adapter, put_expert, random_like, relay_join_token, update_meta
from protocol.integrity import DIGEST_HEADER, digest_header
from protocol.schemas import UPDATE_HEADER
from protocol.tensors import dumps


def join_token(app) -> str:
    return (app.extensions["fedmoe"].config.data_dir / "join_token").read_text().strip()


def relay_join(app) -> str:
    return relay_join_token(app.extensions["fedmoe"].config.data_dir)


def register_relay(app, relay_id="site-a", fingerprint=FINGERPRINT, token=None):
    body = {"relay_id": relay_id, "url": "http://10.0.0.2:5001",
            "base_model": {"id": "tiny-test", "fingerprint": fingerprint}}
    return app.test_client(token=token or relay_join(app)).post("/api/v1/relays", json=body)


def test_the_workers_join_token_cannot_register_a_relay_and_the_relay_join_token_nothing_else(make_app):
    """Issue 30: any holder of the workers' join token got a relay token (uploads without an owner or a limit)."""
    app = make_app()
    assert put_expert(app.test_client(), "e1", make_adapter()).status_code == 201
    r = register_relay(app, token=join_token(app))
    assert r.status_code == 403 and r.json["error"]["details"]["reason"] == "relay_join_token_needed"
    assert "relay_join_token" in r.json["error"]["message"] and "--relay-join-token-file" in r.json["error"]["message"]
    assert app.test_client().get("/api/v1/relays").json["relays"] == []  # nothing registered
    relay_joiner = app.test_client(token=relay_join(app))
    assert relay_joiner.post("/api/v1/workers", json={"worker_id": "w1", "specialty": "e1",
                                                      "base_model": {"id": "m", "fingerprint": FINGERPRINT}}
                             ).status_code == 403
    for r in (relay_joiner.get("/api/v1/experts"), relay_joiner.get("/api/v1/experts/e1/weights"),
              relay_joiner.get("/api/v1/relays")):
        assert r.status_code == 403, r.json
    assert relay_joiner.post("/api/v1/relays", json={"relay_id": "site-z"}).status_code == 200
    assert relay_join(app).startswith("fmrjoin_") and relay_join(app) not in (join_token(app), app.extensions[
        "fedmoe_auth"].admin_token)
    mode = (app.extensions["fedmoe"].config.data_dir / "relay_join_token").stat().st_mode & 0o777
    assert mode == 0o600


def test_relay_join_token_registers_a_relay_whose_token_pushes_to_any_expert(make_app):
    app = make_app()
    admin = app.test_client()
    for name in ("e1", "e2"):
        assert put_expert(admin, name, make_adapter()).status_code == 201
    r = register_relay(app)
    assert r.status_code == 200, r.json
    token = r.json["token"]
    assert token.startswith("fmrly_") and {e["name"] for e in r.json["experts"]} == {"e1", "e2"}
    relay = app.test_client(token=token)
    for name in ("e1", "e2"):
        body = dumps(random_like(make_adapter(), 1))
        pushed = relay.post(f"/api/v1/experts/{name}/updates", data=body,
                            headers={UPDATE_HEADER: json.dumps(update_meta(num_samples=7)),
                                     DIGEST_HEADER: digest_header(body)})
        assert pushed.status_code == 202, pushed.json
        assert relay.get(f"/api/v1/experts/{name}/weights").status_code == 200
    assert admin.get("/api/v1/experts/e2").json["samples_seen"] == 7
    # but it is not the admin, and it reports only for itself
    assert relay.get("/api/v1/gateway/weights").status_code == 403
    assert relay.post("/api/v1/relays/site-b/report", json={}).status_code == 403
    # nor does it mint worker identities at the root (it did: the join token's rule let any token through)
    assert relay.post("/api/v1/workers", json={"worker_id": "w5", "specialty": "e1", "base_model": {
        "id": "m", "fingerprint": FINGERPRINT}}).status_code == 403


def test_a_relay_of_another_base_model_is_refused_with_409(make_app):
    app = make_app()
    assert put_expert(app.test_client(), "e1", make_adapter()).status_code == 201
    r = register_relay(app, fingerprint="12" * 32)
    assert r.status_code == 409
    assert "e1" in r.json["error"]["message"] and "fingerprint" in r.json["error"]["message"]


def test_an_active_relay_id_cannot_be_taken_with_the_relay_join_token_but_renews_with_its_own(make_app):
    app = make_app()
    token = register_relay(app).json["token"]
    assert register_relay(app).status_code == 403
    renewed = register_relay(app, token=token)
    assert renewed.status_code == 200 and renewed.json["token"] != token


def test_reports_build_the_tree_with_bytes_saved_and_workers_cannot_report(make_app):
    app = make_app()
    token = register_relay(app).json["token"]
    stats = {"bytes_received": 3000, "bytes_forwarded": 1000, "bytes_served": 900, "bytes_fetched": 300}
    workers = [{"worker_id": "w1", "specialty": "e1"}, {"worker_id": "w2", "specialty": "e1"}]
    r = app.test_client(token=token).post("/api/v1/relays/site-a/report", json={"workers": workers, "stats": stats})
    assert r.status_code == 200
    (tree,) = app.test_client().get("/api/v1/relays").json["relays"]
    assert tree["relay_id"] == "site-a" and tree["url"] == "http://10.0.0.2:5001"
    assert [w["worker_id"] for w in tree["workers"]] == ["w1", "w2"]
    assert tree["bytes_saved"] == (3000 - 1000) + (900 - 300)
    bad = app.test_client(token=token).post("/api/v1/relays/site-a/report", json={"stats": {"bytes_received": -1}})
    assert bad.status_code == 400
    worker = app.test_client(token=join_token(app)).post(
        "/api/v1/workers", json={"worker_id": "w9", "specialty": "e1",
                                 "base_model": {"id": "m", "fingerprint": FINGERPRINT}}).json["token"]
    assert app.test_client(token=worker).post("/api/v1/relays/site-a/report", json={}).status_code == 403


def test_bad_registrations_are_400(make_app):
    app = make_app()
    joiner = app.test_client(token=relay_join(app))
    assert joiner.post("/api/v1/relays", json={"relay_id": "bad id"}).status_code == 400
    assert joiner.post("/api/v1/relays", json={"relay_id": "a", "url": "ftp://x"}).status_code == 400
    assert joiner.post("/api/v1/relays", json={"relay_id": "a", "base_model": {"id": "m"}}).status_code == 400
