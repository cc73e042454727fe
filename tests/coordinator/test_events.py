"""Norm check through the API, and the audit log (GET /api/v1/events) it and every push write to."""
from __future__ import annotations

import json

import pytest
import torch

from protocol.schemas import UPDATE_HEADER, WORKER_HEADER
from protocol.tensors import loads
from tests.helpers import make_adapter, push, put_expert, random_like, update_meta

NORM_FLAGS = dict(norm_factor=3.0, norm_history=10, norm_warmup=3)


def events(client, **params) -> list[dict]:
    r = client.get("/api/v1/events", query_string=params)
    assert r.status_code == 200, r.get_json()
    return r.get_json()["events"]


def scaled(tensors: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {k: v * factor for k, v in tensors.items()}


def warm_up(client, adapter, n: int = 3) -> dict[str, torch.Tensor]:
    """Push n updates of equal norm (fedasync applies each); returns the base delta."""
    delta = random_like(adapter, 1)
    for i in range(n):
        r = push(client, "e", delta, update_meta(base_version=i, worker_id="w1"))
        assert r.status_code == 202
    return delta


def test_huge_norm_is_a_422_with_the_norm_the_limit_and_the_history(make_app):
    client = make_app(norm_check="reject", **NORM_FLAGS).test_client()
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    delta = warm_up(client, adapter)
    norm = float(torch.sqrt(sum((t ** 2).sum() for t in delta.values())))
    meta = update_meta(base_version=3, worker_id="mallory")
    r = push(client, "e", scaled(delta, 4.0), meta)
    assert r.status_code == 422
    error = r.get_json()["error"]
    assert error["code"] == "invalid_update" and "--norm-factor" in error["message"]
    assert error["details"]["history"] == 3 and error["details"]["reason"] == "norm_too_large"
    assert error["details"]["norm"] == pytest.approx(4 * norm, rel=1e-5)
    assert error["details"]["limit"] == pytest.approx(3 * norm, rel=1e-5)
    assert client.get("/api/v1/experts/e").get_json()["version"] == 3  # not applied
    assert push(client, "e", scaled(delta, 2.9), update_meta(base_version=3)).status_code == 202  # under the limit

    rejected = events(client, kind="update_rejected")
    assert len(rejected) == 1
    assert rejected[0] | {"time": 0, "id": 0, "message": ""} == {
        "id": 0, "time": 0, "kind": "update_rejected", "expert": "e", "worker_id": "mallory",
        "update_id": meta["update_id"], "message": "",
        "detail": rejected[0]["detail"] | {"status": 422, "reason": "norm_too_large"}}
    assert rejected[0]["detail"]["limit"] == pytest.approx(3 * norm, rel=1e-5)
    assert "mallory" in rejected[0]["message"] and "422" in rejected[0]["message"]


def test_clip_mode_applies_the_update_scaled_to_the_limit_also_after_a_restart(make_app):
    settings = dict(norm_check="clip", aggregation="fedbuff", buffer_size=2, **NORM_FLAGS)
    client = make_app(**settings).test_client()
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    delta = random_like(adapter, 1)
    for v in range(3):  # three rounds of two identical updates: six norms in the history
        for _ in range(2):
            assert push(client, "e", delta, update_meta(base_version=v)).status_code == 202
    before = loads(client.get("/api/v1/experts/e/weights").data)
    meta = update_meta(base_version=3, worker_id="big")
    assert push(client, "e", scaled(delta, 10.0), meta).status_code == 202  # pending: the buffer holds one

    client = make_app(**settings).test_client()  # restart: the pending update is re-read from disk
    assert push(client, "e", delta, update_meta(base_version=3)).status_code == 202
    after = loads(client.get("/api/v1/experts/e/weights").data)
    for k in before:  # mean of (3 x delta) and delta, not of (10 x delta) and delta
        torch.testing.assert_close(after[k], before[k] + (3.0 * delta[k] + delta[k]) / 2)
    clipped = events(client, kind="update_clipped")
    assert [e["update_id"] for e in clipped] == [meta["update_id"]]
    assert clipped[0]["worker_id"] == "big" and clipped[0]["detail"]["scale"] == pytest.approx(0.3)


def test_norm_history_survives_a_restart(make_app):
    client = make_app(norm_check="reject", **NORM_FLAGS).test_client()
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    delta = warm_up(client, adapter)
    client = make_app(norm_check="reject", **NORM_FLAGS).test_client()
    assert push(client, "e", scaled(delta, 5.0), update_meta(base_version=3)).status_code == 422


def test_accept_duplicate_version_creation_and_registration_are_logged(client):
    adapter = make_adapter()
    r = client.post("/api/v1/workers", json={"worker_id": "w1", "specialty": "e",
                                             "base_model": {"id": "tiny-test", "fingerprint": "ab" * 32}})
    assert r.status_code == 200
    put_expert(client, "e", adapter)
    meta = update_meta(base_version=0, worker_id="w1")
    delta = random_like(adapter, 1)
    assert push(client, "e", delta, meta).status_code == 202
    assert push(client, "e", delta, meta).status_code == 200
    log = events(client)
    assert [e["kind"] for e in log] == ["update_duplicate", "version_applied", "update_accepted",
                                        "expert_created", "worker_registered"]  # newest first
    assert log[0]["id"] > log[1]["id"] > log[2]["id"]
    duplicate, applied, accepted = log[0], log[1], log[2]
    assert (accepted["worker_id"], accepted["update_id"], accepted["expert"]) == ("w1", meta["update_id"], "e")
    assert accepted["detail"]["num_samples"] == 10 and accepted["detail"]["norm"] > 0
    assert applied["detail"] | {"update_ids": None, "staleness": None} == {
        "version": 1, "num_updates": 1, "train_loss": 1.5, "update_ids": None, "staleness": None,
        "alpha": 1.0, "staleness_grace": 0, "workers_counted": 1, "workers_alive": 1,
        "relays_counted": 0}  # w1 alone on "e", no relay
    assert applied["detail"]["update_ids"] == [meta["update_id"]]
    assert duplicate["update_id"] == meta["update_id"] and duplicate["worker_id"] == "w1"
    assert log[4]["worker_id"] == "w1" and log[4]["expert"] == "e"
    assert all(isinstance(e["time"], float) and e["message"] for e in log)


@pytest.mark.parametrize("case, status, reason", [
    ("bad header", 400, "bad_request"),
    ("undecodable body", 400, "invalid_payload"),
    ("unknown expert", 404, "not_found"),
    ("ahead of the expert", 409, "conflict"),
    ("too large", 413, "payload_too_large"),
    ("wrong shape", 422, "invalid_update"),
])
def test_every_refused_push_is_logged_with_who_and_why(make_app, case, status, reason):
    client = make_app(max_body_mb=0.01).test_client()
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    meta = update_meta(base_version=0, worker_id="w9")
    name, delta, body, headers = "e", random_like(adapter, 1), None, None
    if case == "bad header":
        headers = {UPDATE_HEADER: "{not json", WORKER_HEADER: "w8"}
    elif case == "undecodable body":
        body = b"\x00" * 40
    elif case == "unknown expert":
        name = "nope"
    elif case == "ahead of the expert":
        meta["base_version"] = 5
    elif case == "too large":
        body = b"\x00" * 20000
    else:
        delta = {k: v[:1] for k, v in delta.items()}
    if headers is not None:
        r = client.post(f"/api/v1/experts/{name}/updates", data=b"x", headers=headers)
    else:
        r = push(client, name, delta, meta, body=body)
    assert r.status_code == status and r.get_json()["error"]["code"] == reason
    [event] = events(client, kind="update_rejected")
    assert event["detail"]["status"] == status and event["detail"]["reason"] == reason
    assert event["expert"] == name and event["detail"]["error"] == r.get_json()["error"]["message"]
    if case == "bad header":  # the metadata did not parse: who comes from X-FedMoE-Worker
        assert (event["worker_id"], event["update_id"]) == ("w8", None)
    else:
        assert (event["worker_id"], event["update_id"]) == ("w9", meta["update_id"])


def test_who_falls_back_to_the_remote_address(client):
    r = client.post("/api/v1/experts/e/updates", data=b"x", headers={UPDATE_HEADER: json.dumps([1])})
    assert r.status_code == 400
    [event] = events(client)
    assert event["worker_id"] == "127.0.0.1" and event["detail"]["remote_addr"] == "127.0.0.1"


def test_events_query_parameters(client):
    adapter = make_adapter()
    put_expert(client, "a", adapter)
    put_expert(client, "b", adapter)
    for name in ("a", "b", "a"):
        push(client, name, random_like(adapter, 1), update_meta(base_version=len(events(client, expert=name,
                                                                                           kind="version_applied"))))
    everything = events(client, limit=500)
    assert len(everything) == 2 + 3 * 2 and [e["id"] for e in everything] == sorted(
        (e["id"] for e in everything), reverse=True)
    assert len(events(client)) == 8  # default limit 50
    assert [e["id"] for e in events(client, limit=3)] == [e["id"] for e in everything[:3]]
    cut = everything[3]["id"]
    assert [e["id"] for e in events(client, after=cut)] == [e["id"] for e in everything[:3]]
    assert {e["expert"] for e in events(client, expert="b")} == {"b"} and len(events(client, expert="b")) == 3
    assert [e["expert"] for e in events(client, kind="expert_created")] == ["b", "a"]
    assert events(client, kind="worker_revoked") == []


@pytest.mark.parametrize("query", ["limit=0", "limit=501", "limit=-1", "limit=ten", "after=x", "after=-3",
                                   "after=99999999999999999999"])
def test_bad_events_parameters_are_400(client, query):
    r = client.get(f"/api/v1/events?{query}")
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "bad_request"
    assert query.split("=")[0] in r.get_json()["error"]["message"]
