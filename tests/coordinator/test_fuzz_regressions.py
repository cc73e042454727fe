"""5xx bugs schemathesis found (tests/e2e/test_openapi_fuzz.py), each pinned as a 400 here."""
import pytest

from protocol.profiles import profile_to_json, text_profile
from tests.helpers import make_adapter, push, put_expert, random_like, update_meta


@pytest.mark.parametrize("query", ["version=054299218180064116872960", "since=99999999999999999999",
                                   "version=%C2%B2", "since=%D9%A1"])  # overflow, '²', Arabic-Indic 1
def test_version_query_outside_64_bit_ascii_integers_is_400(client, query):
    put_expert(client, "e", make_adapter())
    r = client.get(f"/api/v1/experts/e/weights?{query}")
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "bad_request"


@pytest.mark.parametrize("field", ["num_samples", "base_version"])
def test_counts_too_big_for_sqlite_are_400_and_nothing_is_recorded(client, field):
    """Before: num_samples 2**70 was recorded, then failed to apply on every start (a crash loop)."""
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    meta = update_meta() | {field: 2**70}
    r = push(client, "e", random_like(adapter, 1), meta)
    assert r.status_code == 400 and field in r.get_json()["error"]["message"]
    assert client.get(f"/api/v1/updates/{meta['update_id']}").status_code == 404


def test_profile_count_too_big_for_sqlite_is_400(client):
    put_expert(client, "e", make_adapter())
    profile = profile_to_json(text_profile(["SELECT 1"]), 1) | {"num_examples": 2**70}
    r = client.put("/api/v1/experts/e/profiles/w1", json=profile)
    assert r.status_code == 400 and "num_examples" in r.get_json()["error"]["message"]
