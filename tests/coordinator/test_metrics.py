"""GET /metrics parses as Prometheus text and its counters move with real requests."""
import re

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import make_adapter, push, put_expert, random_like, update_meta


def scrape(client) -> dict[tuple[str, tuple], float]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.mimetype == "text/plain"
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.get_data(as_text=True)) for s in family.samples}


def test_counters_and_gauges_follow_pushes_and_pulls(client):
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    before = scrape(client)
    assert before[("fedmoe_expert_version", (("expert", "e"),))] == 0

    body_meta = update_meta()
    r = push(client, "e", random_like(adapter, 1), body_meta)
    push(client, "e", random_like(adapter, 1), body_meta)  # duplicate
    push(client, "e", None, body=b"not safetensors")       # rejected
    pulled = client.get("/api/v1/experts/e/weights")
    after = scrape(client)

    assert after[("fedmoe_expert_version", (("expert", "e"),))] == 1
    for outcome in ("accepted", "duplicate", "rejected"):
        assert after[("fedmoe_updates_total", (("expert", "e"), ("outcome", outcome)))] == 1
    assert after[("fedmoe_update_bytes_total", (("direction", "in"), ("expert", "e")))] == r.request.content_length
    assert after[("fedmoe_update_bytes_total", (("direction", "out"), ("expert", "e")))] == len(pulled.data)
    assert after[("fedmoe_aggregation_seconds_count", ())] == 1
    key = ("fedmoe_http_requests_total", (("method", "POST"), ("route", "/api/v1/experts/<name>/updates"),
                                          ("status", "202")))
    assert after[key] == 1


def test_workers_gauge_counts_liveness(client):
    base = {"id": "tiny-test", "fingerprint": "ab" * 32}
    client.post("/api/v1/workers", json={"worker_id": "w1", "specialty": "e", "base_model": base})
    assert scrape(client)[("fedmoe_workers", (("status", "alive"),))] == 1


def test_dashboard_page_is_self_contained_and_uses_the_json_api(client):
    r = client.get("/")
    page = r.get_data(as_text=True)
    assert r.status_code == 200 and r.mimetype == "text/html"
    for endpoint in ("api/v1/experts", "api/v1/workers", "api/v1/gateway", "api/v1/events"):
        assert endpoint in page
    # No external scripts, styles or fonts: the only absolute URL is SVG's namespace name, never fetched.
    assert re.findall(r"https?://[^\s\"'`]+", page) == ["http://www.w3.org/2000/svg"]
    assert "<script src" not in page and "<link" not in page and "@import" not in page and "url(" not in page
