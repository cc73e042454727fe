"""The root's placement routes (coordinator/api/placement.py): probe reports in, each worker's assignment and the plan out."""
from __future__ import annotations

from tests.coordinator.test_relays import join_token, register_relay
from tests.helpers import FINGERPRINT

WAN = {"rtt_ms": 50.0, "mbps": 20.0}
LAN = {"rtt_ms": 1.0, "mbps": 900.0}


def worker_client(app, worker_id: str):
    body = {"worker_id": worker_id, "specialty": "e1", "base_model": {"id": "tiny-test", "fingerprint": FINGERPRINT}}
    r = app.test_client(token=join_token(app)).post("/api/v1/workers", json=body)
    assert r.status_code in (200, 201), r.json
    return app.test_client(token=r.json["token"])


def report(client, worker_id: str, links: dict):
    return client.post(f"/api/v1/workers/{worker_id}/probes", json={"links": links})


def test_two_workers_near_a_relay_are_assigned_to_it_and_the_plan_shows_its_url(make_app):
    app = make_app()
    assert register_relay(app, relay_id="site-a").status_code == 200  # published at http://10.0.0.2:5001
    w1, w2 = worker_client(app, "w1"), worker_client(app, "w2")
    first = report(w1, "w1", {"root": WAN, "site-a": LAN, "gone-relay": LAN})  # an unknown host is ignored
    assert first.status_code == 200 and first.json["relay_id"] is None  # a group of one syncs with the root
    second = report(w2, "w2", {"root": WAN, "site-a": LAN})
    assert second.status_code == 200 and second.json["relay_id"] == "site-a", second.json
    assert report(w1, "w1", {"root": WAN, "site-a": LAN}).json["relay_id"] == "site-a"
    plan = w1.get("/api/v1/placement").json
    assert [(g["members"], g["relay_id"], g["relay_url"]) for g in plan["groups"]] == [
        (["w1", "w2"], "site-a", "http://10.0.0.2:5001")]
    assert plan["generation"] >= 1


def test_a_worker_reports_only_for_itself_and_a_malformed_report_is_a_400_that_changes_nothing(make_app):
    app = make_app()
    w1 = worker_client(app, "w1")
    worker_client(app, "w2")
    r = report(w1, "w2", {"root": WAN})
    assert r.status_code == 403 and "w2" in r.json["error"]["message"]
    for links, words in (({"site-a": LAN}, 'measure the root'), ({"root": {"rtt_ms": "fast"}}, "rtt_ms"),
                         ({"root": {"rtt_ms": 5, "mbps": -1}}, "mbps"), ({"root": 3}, "object")):
        r = report(w1, "w1", links)
        assert r.status_code == 400 and words in r.json["error"]["message"], (links, r.json)
    r = w1.post("/api/v1/workers/w1/probes", data="not json", content_type="application/json")
    assert r.status_code == 400
    r = report(app.test_client(), "never-registered", {"root": WAN})  # the admin, for a worker the root never saw
    assert r.status_code == 404 and "register first" in r.json["error"]["message"]
    assert w1.get("/api/v1/placement").json["groups"] == []  # nothing was planned from the refused reports
    assert app.test_client(token=None).get("/api/v1/placement").status_code == 401
