"""Who did what: identity comes from the token, refusals are audited under the caller, ids cannot be taken over."""
from __future__ import annotations

import json
import time

from protocol.integrity import DIGEST_HEADER, digest_header
from protocol.schemas import EXPERT_HEADER, UPDATE_HEADER, WORKER_HEADER
from protocol.tensors import dumps
from tests.coordinator.test_auth import BASE, error, join_token, push, put_expert, register
from tests.helpers import expert_spec, make_adapter, update_meta


def events(app, **params) -> list[dict]:
    r = app.test_client().get("/api/v1/events", query_string=params)
    assert r.status_code == 200, r.get_json()
    return r.get_json()["events"]


def workers(app) -> dict[str, dict]:
    return {w["worker_id"]: w for w in app.test_client().get("/api/v1/workers").get_json()["workers"]}


def registration(client, worker_id: str, specialty: str = "e", base_model: dict | None = None):
    return client.post("/api/v1/workers", json={"worker_id": worker_id, "specialty": specialty,
                                                "base_model": base_model or BASE})


def test_a_push_without_worker_id_is_recorded_under_the_tokens_worker(make_app):
    app = make_app()
    worker = app.test_client(token=register(app, "w1", "e"))
    assert put_expert(worker, "e").status_code == 201
    meta = update_meta()
    assert "worker_id" not in meta
    assert push(worker, "e", meta).status_code == 202
    [accepted] = events(app, kind="update_accepted")
    assert (accepted["worker_id"], accepted["update_id"]) == ("w1", meta["update_id"])
    assert workers(app)["w1"]["updates_sent"] == 1


def test_a_push_for_another_worker_is_logged_under_the_caller(make_app):
    app = make_app()
    register(app, "w2", "e")
    worker = app.test_client(token=register(app, "w1", "e"))
    assert put_expert(worker, "e").status_code == 201
    assert put_expert(app.test_client(), "other").status_code == 201
    r = push(worker, "e", update_meta(worker_id="w2"))
    assert error(r) == (403, "forbidden")
    assert error(push(worker, "other", update_meta(worker_id="w2"))) == (403, "forbidden")  # refused before the view
    rows = events(app, kind="update_rejected")
    assert [(e["expert"], e["worker_id"], e["detail"]["status"]) for e in rows] == [("other", "w1", 403),
                                                                                     ("e", "w1", 403)]
    assert all(e["detail"]["claimed_worker_id"] == "w2" for e in rows)
    assert workers(app)["w2"]["updates_sent"] == 0


def test_the_worker_header_on_pulls_must_match_the_token(make_app):
    app = make_app()
    register(app, "w2", "e")
    worker = app.test_client(token=register(app, "w1", "e"))
    assert put_expert(worker, "e").status_code == 201
    for query in ({}, {"since": 0, "codec": "fp16"}):
        r = worker.get("/api/v1/experts/e/weights", query_string=query, headers={WORKER_HEADER: "w2"})
        assert error(r) == (403, "forbidden") and WORKER_HEADER in r.get_json()["error"]["message"]
    assert worker.get("/api/v1/experts/e/weights").status_code == 200  # no header: counted for w1 anyway
    assert worker.get("/api/v1/experts/e/weights", headers={WORKER_HEADER: "w1"}).status_code == 200
    counts = {w: info["pulls"] for w, info in workers(app).items()}
    assert counts == {"w1": 2, "w2": 0}
    refused = events(app, kind="request_refused")
    assert [(e["worker_id"], e["detail"]["status"], e["detail"]["method"]) for e in refused] == [("w1", 403, "GET")] * 2


def test_a_lone_surrogate_in_metadata_still_leaves_a_rejection_row(make_app):
    app = make_app()
    client = app.test_client()
    assert put_expert(client, "e").status_code == 201
    body = dumps(make_adapter())
    header = '{"update_id": "u\\ud800", "base_version": 0, "num_samples": 1, "worker_id": "w\\udfff"}'
    r = client.post("/api/v1/experts/e/updates", data=body,
                    headers={UPDATE_HEADER: header, DIGEST_HEADER: digest_header(body)})
    assert error(r) == (400, "bad_request")
    [row] = events(app, kind="update_rejected")
    assert (row["update_id"], row["worker_id"]) == ("u\\ud800", "w\\udfff")
    # a registration whose base model id holds one is stored too (it was a 500)
    r = registration(client, "w1", base_model={"id": "m\ud800", "fingerprint": BASE["fingerprint"]})
    assert r.status_code == 200, r.get_json()
    assert events(app, kind="worker_registered")[0]["message"].endswith("for e")


def test_the_join_token_cannot_take_over_an_active_worker_id(make_app):
    app = make_app()
    own = register(app, "w1", "e")
    joiner = app.test_client(token=join_token(app))
    r = registration(joiner, "w1")
    assert error(r) == (403, "forbidden") and r.get_json()["error"]["details"] == {"reason": "worker_id_in_use"}
    assert "another --worker-id" in r.get_json()["error"]["message"]
    # its own token renews it; another worker's token, or its own for another specialty, cannot
    renewed = registration(app.test_client(token=own), "w1")
    assert renewed.status_code == 200 and renewed.get_json()["token"] != own
    other = register(app, "w2", "e")
    assert error(registration(app.test_client(token=other), "w1")) == (403, "forbidden")
    assert error(registration(app.test_client(token=own), "w1", specialty="f")) == (403, "forbidden")
    assert error(registration(app.test_client(token=own), "w3")) == (403, "forbidden")
    assert registration(app.test_client(), "w1").status_code == 200  # the admin can
    refused = events(app, kind="request_refused")
    assert [(e["worker_id"], e["detail"]["role"]) for e in refused] == [("w1", "worker"), ("w1", "worker"),
                                                                         ("w2", "worker"), (None, "join")]


def test_an_expired_token_still_renews_its_worker_and_nothing_else(make_app):
    app = make_app(token_ttl_hours=0.5 / 3600)
    own, first = register(app, "w1", "e"), register(app, "w2", "e")
    now = time.time()
    app.extensions["fedmoe_auth"].tokens.clock = lambda: now + 1  # a second later: both tokens expired
    worker = app.test_client(token=own)
    assert error(worker.get("/api/v1/experts")) == (401, "unauthorized")
    r = registration(worker, "w1")
    assert r.status_code == 200
    assert app.test_client(token=r.get_json()["token"]).get("/api/v1/experts").status_code == 200
    assert registration(app.test_client(token=first), "w2").status_code == 200
    register(app, "w3", "e")  # each issue drops expired tokens but every worker's newest: w2's first goes
    assert error(registration(app.test_client(token=first), "w2")) == (401, "unauthorized")
    assert [e["worker_id"] for e in events(app, kind="request_refused")] == [None, "w1"]  # the caller, if known


def test_refusals_before_the_view_are_logged_throttled_per_caller(make_app):
    app = make_app(rate_limit=2)
    anonymous = app.test_client(token=None)
    for _ in range(20):
        assert error(anonymous.get("/api/v1/experts")) == (401, "unauthorized")
    worker = app.test_client(token=register(app, "w1", "e"))
    assert [worker.get("/api/v1/experts").status_code for _ in range(3)] == [200, 200, 429]
    refused = events(app, kind="request_refused")
    assert [e["detail"]["status"] for e in refused].count(401) == 6  # REFUSALS_LOGGED_PER_CALLER a minute
    assert (refused[0]["worker_id"], refused[0]["detail"]["status"], refused[0]["detail"]["role"]) == \
        ("w1", 429, "worker")
    assert refused[-1]["worker_id"] is None and refused[-1]["detail"]["role"] == "unknown"
    assert json.dumps(refused)  # every row reads back as JSON


def test_the_creator_of_an_expert_is_the_tokens_worker(make_app):
    app = make_app()
    register(app, "w2", "e")
    worker = app.test_client(token=register(app, "w1", "e"))
    spec = expert_spec() | {"worker_id": "w2"}
    body = dumps(make_adapter())
    headers = {EXPERT_HEADER: json.dumps(spec), DIGEST_HEADER: digest_header(body)}
    r = worker.put("/api/v1/experts/e", data=body, headers=headers)
    assert error(r) == (403, "forbidden") and EXPERT_HEADER in r.get_json()["error"]["message"]
    assert put_expert(worker, "e").status_code == 201  # no worker_id in the spec: the token's is stored
    stored = app.extensions["fedmoe"].store.rows.expert("e").spec
    assert stored["worker_id"] == "w1"
