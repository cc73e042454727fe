"""Authentication, scoping, revocation, body digests and rate limits, through the Flask test client."""
from __future__ import annotations

import json
import os
import stat
import time

import pytest

from coordinator.access.ratelimit import RateLimiter
from protocol.integrity import DIGEST_HEADER, digest_header
from protocol.schemas import EXPERT_HEADER, UPDATE_HEADER
from protocol.tensors import dumps
from tests.helpers import FINGERPRINT, expert_spec, make_adapter, random_like, update_meta

BASE = {"id": "tiny-test", "fingerprint": FINGERPRINT}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def join_token(app) -> str:
    return (app.extensions["fedmoe"].config.data_dir / "join_token").read_text().strip()


def register(app, worker_id: str, specialty: str) -> str:
    r = app.test_client(token=join_token(app)).post(
        "/api/v1/workers", json={"worker_id": worker_id, "specialty": specialty, "base_model": BASE})
    assert r.status_code == 200, r.get_json()
    return r.get_json()["token"]


def put_expert(client, name: str, body: bytes | None = None, digest: str | None = "auto"):
    body = dumps(make_adapter()) if body is None else body
    headers = {EXPERT_HEADER: json.dumps(expert_spec())}
    if digest is not None:
        headers[DIGEST_HEADER] = digest_header(body) if digest == "auto" else digest
    return client.put(f"/api/v1/experts/{name}", data=body, headers=headers)


def push(client, name: str, meta: dict | None = None):
    body = dumps(random_like(make_adapter(), seed=1))
    return client.post(f"/api/v1/experts/{name}/updates", data=body,
                       headers={UPDATE_HEADER: json.dumps(meta or update_meta()), DIGEST_HEADER: digest_header(body)})


def error(response) -> tuple[int, str]:
    return response.status_code, response.get_json()["error"]["code"]


def test_public_endpoints_need_no_token_and_the_rest_do(make_app):
    anonymous = make_app().test_client(token=None)
    assert anonymous.get("/api/v1/health").status_code == 200
    assert anonymous.get("/").status_code == 200
    for path in ("/api/v1/experts", "/api/v1/workers", "/api/v1/gateway", "/metrics"):
        assert error(anonymous.get(path)) == (401, "unauthorized"), path
    assert "Authorization: Bearer" in anonymous.get("/api/v1/experts").get_json()["error"]["message"]
    assert error(anonymous.get("/api/v1/experts", headers=bearer("fmadm_not-the-token"))) == (401, "unauthorized")
    assert error(anonymous.get("/api/v1/experts", headers={"Authorization": "Basic abc"})) == (401, "unauthorized")


def test_the_default_test_client_is_the_admin(make_app):
    app = make_app()
    assert put_expert(app.test_client(), "e").status_code == 201
    assert app.test_client().get("/api/v1/gateway/weights").status_code in (200, 404)


def test_join_token_registers_and_reads_but_cannot_write(make_app):
    app = make_app()
    joiner = app.test_client(token=join_token(app))
    r = joiner.post("/api/v1/workers", json={"worker_id": "w1", "specialty": "e", "base_model": BASE})
    assert r.status_code == 200 and r.get_json()["token"].startswith("fmwrk_")
    assert r.get_json()["token_expires_at"] > time.time() + 100 * 3600
    assert joiner.get("/api/v1/experts").status_code == 200
    assert error(put_expert(joiner, "e")) == (403, "forbidden")
    assert error(joiner.get("/api/v1/gateway/weights")) == (403, "forbidden")
    assert error(joiner.delete("/api/v1/workers/w1")) == (403, "forbidden")


def test_a_worker_token_is_scoped_to_its_specialty_and_its_own_worker(make_app):
    app = make_app()
    worker = app.test_client(token=register(app, "w1", "e"))
    register(app, "w2", "e")
    assert put_expert(worker, "e").status_code == 201
    assert push(worker, "e", update_meta(worker_id="w1")).status_code == 202
    assert worker.get("/api/v1/experts/e/weights").status_code == 200
    assert worker.post("/api/v1/workers/w1/heartbeat").status_code == 200
    assert worker.get("/api/v1/experts").status_code == 200
    assert put_expert(app.test_client(), "other").status_code == 201
    for response in (put_expert(worker, "other"), push(worker, "other"), worker.get("/api/v1/experts/other/weights"),
                     worker.post("/api/v1/workers/w2/heartbeat"), push(worker, "e", update_meta(worker_id="w2")),
                     worker.put("/api/v1/experts/e/profiles/w2", json={}),
                     worker.post("/api/v1/workers", json={"worker_id": "w3", "specialty": "other", "base_model": BASE}),
                     worker.get("/api/v1/gateway/weights"), worker.delete("/api/v1/workers/w2")):
        assert error(response) == (403, "forbidden"), response.get_json()
    assert "is for expert 'e', not 'other'" in push(worker, "other").get_json()["error"]["message"]


def test_revoked_worker_gets_401_and_cannot_register_again(make_app):
    app = make_app()
    token = register(app, "w1", "e")
    worker, admin = app.test_client(token=token), app.test_client()
    assert put_expert(worker, "e").status_code == 201
    assert admin.delete("/api/v1/workers/w1").get_json() == {"worker_id": "w1", "revoked": True, "tokens": 1}
    r = push(worker, "e")
    assert error(r) == (401, "unauthorized") and r.get_json()["error"]["details"] == {"reason": "revoked"}
    again = app.test_client(token=join_token(app)).post(
        "/api/v1/workers", json={"worker_id": "w1", "specialty": "e", "base_model": BASE})
    assert error(again) == (403, "forbidden")
    assert {w["worker_id"]: w["revoked"] for w in admin.get("/api/v1/workers").get_json()["workers"]} == {"w1": True}
    assert error(admin.delete("/api/v1/workers/nobody")) == (404, "not_found")
    # a restart keeps the revocation
    assert error(push(make_app().test_client(token=token), "e")) == (401, "unauthorized")


def test_expired_worker_token_gets_401_and_registering_renews_it(make_app):
    app = make_app(token_ttl_hours=1.0)
    tokens = app.extensions["fedmoe_auth"].tokens
    token = register(app, "w1", "e")
    assert app.test_client(token=token).get("/api/v1/experts").status_code == 200  # valid, and now cached
    now = time.time()
    tokens.clock = lambda: now + 3600 + 1  # an hour and a second later
    r = app.test_client(token=token).get("/api/v1/experts")
    assert error(r) == (401, "unauthorized") and r.get_json()["error"]["details"] == {"reason": "expired"}
    assert app.test_client(token=register(app, "w1", "e")).get("/api/v1/experts").status_code == 200


def test_body_digest_is_checked_and_a_mismatch_stores_nothing(make_app):
    app = make_app()
    c = app.extensions["fedmoe"]
    admin = app.test_client()
    body = dumps(make_adapter())
    wrong = "sha256=" + "0" * 64
    assert error(put_expert(admin, "e", body, digest=wrong)) == (400, "bad_request")
    assert error(put_expert(admin, "e", body, digest="md5=abc")) == (400, "bad_request")
    assert admin.get("/api/v1/experts").get_json()["experts"] == []
    assert list(c.store._blobs.tmp_dir.iterdir()) == [] and list(c.store._blobs.digests()) == []
    assert put_expert(admin, "e", body).status_code == 201
    # the admin may omit the digest (curl); a worker token must send one
    assert put_expert(admin, "e", body, digest=None).status_code == 200
    worker = app.test_client(token=register(app, "w1", "e"))
    r = put_expert(worker, "e", body, digest=None)
    assert error(r) == (400, "bad_request") and DIGEST_HEADER in r.get_json()["error"]["message"]


def test_rate_limit_answers_429_with_retry_after_per_worker(make_app):
    app = make_app(rate_limit=3)
    w1, w2 = (app.test_client(token=register(app, w, "e")) for w in ("w1", "w2"))
    assert [w1.get("/api/v1/experts").status_code for _ in range(4)] == [200, 200, 200, 429]
    r = w1.get("/api/v1/experts")
    assert error(r) == (429, "too_many_requests") and int(r.headers["Retry-After"]) == 20  # 3/min: one per 20 s
    assert w2.get("/api/v1/experts").status_code == 200  # buckets are per worker
    assert all(app.test_client().get("/api/v1/experts").status_code == 200 for _ in range(10))  # admin: no limit
    joiner = app.test_client(token=join_token(app))  # two registrations above + one read: its third
    assert [joiner.get("/api/v1/experts").status_code for _ in range(2)] == [200, 429]


def test_rate_limiter_refills_at_the_configured_rate():
    now = [0.0]
    limiter = RateLimiter(60, clock=lambda: now[0])  # one per second, bursts of 60
    assert all(limiter.acquire("w") == 0 for _ in range(60))
    assert limiter.acquire("w") == pytest.approx(1.0)
    now[0] = 0.5
    assert limiter.acquire("w") == pytest.approx(0.5)
    now[0] = 1.0
    assert limiter.acquire("w") == 0 and limiter.acquire("w") > 0
    assert limiter.acquire("other") == 0


def test_tokens_are_files_of_mode_0600_kept_across_restarts_and_stored_hashed(make_app, tmp_path):
    app = make_app()
    data = app.extensions["fedmoe"].config.data_dir
    admin, join = (data / "admin_token").read_text().strip(), join_token(app)
    for name in ("admin_token", "join_token"):
        assert stat.S_IMODE(os.stat(data / name).st_mode) == 0o600
    worker_token = register(app, "w1", "e")
    assert make_app().test_client(token=admin).get("/api/v1/workers").status_code == 200
    assert join_token(make_app()) == join
    stored = (data / "auth.sqlite").read_bytes()
    assert worker_token.encode() not in stored and admin.encode() not in stored


def test_admin_token_file_and_bad_token_files(make_app, tmp_path):
    token_file = tmp_path / "admin"
    token_file.write_text("my-own-admin-token-0123456789\n")
    app = make_app(admin_token_file=token_file)
    assert app.test_client(token="my-own-admin-token-0123456789").delete("/api/v1/workers/x").status_code == 404
    token_file.write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        make_app(admin_token_file=token_file, data_dir=tmp_path / "other")


def test_endpoints_added_later_need_read_for_get_and_admin_otherwise(make_app):
    app = make_app()
    app.add_url_rule("/api/v1/new", "new_thing", lambda: {"ok": True}, methods=["GET", "POST"])
    joiner = app.test_client(token=join_token(app))
    assert joiner.get("/api/v1/new").status_code == 200
    assert error(joiner.post("/api/v1/new")) == (403, "forbidden")
    assert app.test_client().post("/api/v1/new").status_code == 200


def test_no_auth_needs_no_token_and_issues_none(make_app):
    app = make_app(auth=False)
    anonymous = app.test_client(token=None)
    r = anonymous.post("/api/v1/workers", json={"worker_id": "w1", "specialty": "e", "base_model": BASE})
    assert r.status_code == 200 and "token" not in r.get_json()
    assert put_expert(anonymous, "e").status_code == 201
    assert error(put_expert(anonymous, "f", digest="sha256=" + "1" * 64)) == (400, "bad_request")
    assert not (app.extensions["fedmoe"].config.data_dir / "join_token").exists()


def test_with_auth_off_there_is_nothing_to_revoke(make_app):
    anonymous = make_app(auth=False).test_client(token=None)
    anonymous.post("/api/v1/workers", json={"worker_id": "w1", "specialty": "e", "base_model": BASE})
    assert error(anonymous.delete("/api/v1/workers/w1")) == (404, "not_found")  # as when the route was auth's
    assert anonymous.post("/api/v1/workers/w1/heartbeat").status_code == 200  # and w1 is still registered
