"""Routing prompts to experts through the API, from profiles workers send."""
import pytest

from protocol.profiles import profile_to_json, text_profile
from gateway.router import DEFAULT_THRESHOLD
from tests.helpers import make_adapter, put_expert

SQL = [f"Write a SQL query that selects the {c} column from the {t} table where {c} > {i}"
       for i, (c, t) in enumerate([("salary", "employees"), ("price", "orders"), ("age", "users")] * 5)]
PY = [f"Write a Python function `{n}(items)` that returns a list of {n} values using a for loop"
      for n in ["even", "odd", "unique", "sorted", "reversed"] * 3]


@pytest.fixture
def routed(client):
    for name, texts in [("sql_expert", SQL), ("python_expert", PY)]:
        put_expert(client, name, make_adapter())
        r = client.put(f"/api/v1/experts/{name}/profiles/w-{name}", json=profile_to_json(text_profile(texts), len(texts)))
        assert r.status_code == 200 and r.get_json()["num_examples"] == len(texts)
    return client


def test_prompts_go_to_the_expert_whose_data_they_resemble(routed):
    r = routed.post("/api/v1/route", json={"prompt": "Write a SQL query that selects the name column from the staff table"})
    body = r.get_json()
    assert r.status_code == 200 and body["expert"] == "sql_expert" and body["target"] == "sql_expert"
    assert body["scores"]["sql_expert"] > body["scores"]["python_expert"] and body["confidence"] > 0.7
    body = routed.post("/api/v1/route", json={"prompt": "Write a Python function `odd(items)` using a loop"}).get_json()
    assert body["expert"] == "python_expert"


def test_unsure_prompts_go_to_the_gateway(routed):
    body = routed.post("/api/v1/route", json={"prompt": "Write a SQL query", "threshold": 1.0}).get_json()
    assert body["expert"] is None and body["target"] == "gateway"


def test_profiles_of_several_workers_are_combined(routed):
    extra = profile_to_json(text_profile(["Write a SQL query that deletes rows from the orders table"]), 1)
    assert routed.put("/api/v1/experts/sql_expert/profiles/w2", json=extra).status_code == 200
    assert routed.post("/api/v1/route", json={"prompt": SQL[0]}).get_json()["expert"] == "sql_expert"


def test_a_wrong_expert_is_told_apart_from_a_fallback_in_the_answer_and_the_metrics(routed):
    sql = "Write a SQL query that selects the name column from the staff table"
    right = routed.post("/api/v1/route", json={"prompt": sql, "expected": "sql_expert"}).get_json()
    wrong = routed.post("/api/v1/route", json={"prompt": sql, "expected": "python_expert"}).get_json()
    fallback = routed.post("/api/v1/route", json={"prompt": sql, "expected": "sql_expert", "threshold": 1.0}).get_json()
    assert (right["outcome"], wrong["outcome"], fallback["outcome"]) == ("right", "wrong_expert", "fallback")
    assert abs(sum(right["probabilities"].values()) - 1) < 1e-6 and right["probabilities"]["sql_expert"] > 0.7
    routed.post("/api/v1/route", json={"prompt": sql})
    metrics = routed.get("/metrics").get_data(as_text=True)
    for expected, outcome in (("sql_expert", "right"), ("python_expert", "wrong_expert"), ("sql_expert", "fallback"),
                              ("", "expert")):
        assert f'fedmoe_routes_total{{expected="{expected}",outcome="{outcome}"}} 1.0' in metrics


@pytest.mark.parametrize("body", [{}, {"prompt": ""}, {"prompt": 3}, {"prompt": "x", "threshold": 2}, [],
                                  {"prompt": "x", "expected": 3}, {"prompt": "x", "expected": "no_such_expert"}])
def test_bad_route_requests_are_400(routed, body):
    r = routed.post("/api/v1/route", json=body)
    assert r.status_code == 400 and r.get_json()["error"]["message"]


def test_route_without_profiles_is_404(client):
    assert client.post("/api/v1/route", json={"prompt": "hello"}).status_code == 404


@pytest.mark.parametrize("mangle", [
    lambda p: {**p, "vector": p["vector"][:-1]},
    lambda p: {**p, "vector": ["x"] * len(p["vector"])},
    lambda p: {**p, "dim": 7},
    lambda p: {**p, "num_examples": -1},
    lambda p: {**p, "num_examples": 0},
    lambda p: {"format": "pickle"},
])
def test_bad_profiles_are_400(client, mangle):
    put_expert(client, "e", make_adapter())
    good = profile_to_json(text_profile(SQL), len(SQL))
    r = client.put("/api/v1/experts/e/profiles/w1", json=mangle(good))
    assert r.status_code == 400 and r.get_json()["error"]["message"]


def test_profile_for_unknown_expert_is_404(client):
    r = client.put("/api/v1/experts/nobody/profiles/w1", json=profile_to_json(text_profile(SQL), 1))
    assert r.status_code == 404


def test_profiles_endpoint_routes_locally_as_the_coordinator_does(routed):
    """GET /profiles gives what a server needs to route on its own (serving/routing.py) and agree with /route."""
    from serving.routing import LocalRouter

    extra = profile_to_json(text_profile(["Write a SQL query that deletes rows from the orders table"]), 1)
    routed.put("/api/v1/experts/sql_expert/profiles/w2", json=extra)
    body = routed.get("/api/v1/profiles").get_json()
    assert set(body["profiles"]) == {"sql_expert", "python_expert"} and body["threshold"] == DEFAULT_THRESHOLD
    assert body["profiles"]["sql_expert"]["num_examples"] == len(SQL) + 1
    router = LocalRouter()
    router.update(body)
    for prompt in [SQL[3], PY[2], "Write a SQL query", "hello there"]:
        remote = routed.post("/api/v1/route", json={"prompt": prompt}).get_json()
        local = router.route(prompt, {"sql_expert", "python_expert"})
        assert local.expert == remote["expert"] and local.confidence == pytest.approx(remote["confidence"], abs=1e-6)


def test_profiles_endpoint_without_profiles_is_empty(client):
    assert client.get("/api/v1/profiles").get_json()["profiles"] == {}
