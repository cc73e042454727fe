"""The gateway's lifecycle: reads only read, builds coalesce, old gateways are pruned, settings reach the merge."""
import time

import pytest

from coordinator.config import CoordinatorConfig
from tests.helpers import make_adapter, push, put_expert, random_like


def stored(app) -> tuple[int, int]:
    """(gateway rows, blob files) in the coordinator's data dir."""
    c = app.extensions["fedmoe"]
    rows = c.store._rows._one("SELECT COUNT(*) AS n FROM gateways")["n"]
    return rows, len(list(c.store._blobs.digests()))


def settled(app, expected: tuple[int, int], timeout: float = 60.0) -> tuple[int, int]:
    """stored(app) once it equals ``expected`` or ``timeout`` s passed: the builder thread records a new gateway
    (which a read then sees) before it deletes the blobs of the gateways that one pruned."""
    deadline = time.monotonic() + timeout
    while (now := stored(app)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return now


def test_polling_the_gateway_writes_nothing(make_app):
    app = make_app()
    client = app.test_client()
    put_expert(client, "a", make_adapter(seed=1))
    first = client.get("/api/v1/gateway").get_json()
    before = stored(app)
    for _ in range(20):
        assert client.get("/api/v1/gateway").get_json()["version"] == first["version"]
        assert client.get("/api/v1/gateway/weights").status_code == 200
    assert stored(app) == before == (1, 2)  # one gateway; blobs: expert version 0 and the gateway
    assert app.extensions["fedmoe"].gateway.builds == 1


def test_old_gateways_and_their_blobs_are_pruned(make_app):
    app = make_app(keep_gateways=2, keep_versions=1)
    client = app.test_client()
    adapter = make_adapter(seed=1)
    put_expert(client, "a", adapter)
    versions = []
    for i in range(5):
        push(client, "a", random_like(adapter, i + 10))
        info = client.get("/api/v1/gateway").get_json()
        assert info["stale"] is False and info["sources"] == {"a": i + 1}
        versions.append(info["version"])
        assert stored(app)[0] <= 2
    assert versions == sorted(set(versions)) and len(versions) == 5
    # keep_versions=1: one expert blob; keep_gateways=2: two gateway blobs, nothing else left behind
    assert settled(app, (2, 3)) == (2, 3)
    assert client.get("/api/v1/gateway/weights").headers["X-FedMoE-Version"] == str(versions[-1])


def test_changes_within_the_interval_coalesce_and_reads_get_the_stale_gateway(make_app):
    app = make_app(gateway_interval=3600)
    client = app.test_client()
    adapter = make_adapter(seed=1)
    put_expert(client, "a", adapter)
    first = client.get("/api/v1/gateway").get_json()  # the first build is never held back
    assert first["stale"] is False and first["sources"] == {"a": 0}
    for i in range(3):
        push(client, "a", random_like(adapter, i + 10))
    info = client.get("/api/v1/gateway").get_json()  # answered at once, not rebuilt under the read
    assert info["stale"] is True and info["version"] == first["version"] and info["sources"] == {"a": 0}
    assert app.extensions["fedmoe"].gateway.builds == 1


def test_a_download_can_ask_for_the_gateway_of_the_experts_as_they_are_now(make_app):
    app = make_app(gateway_interval=3600)
    client = app.test_client()
    adapter = make_adapter(seed=1)
    put_expert(client, "a", adapter)
    first = client.get("/api/v1/gateway").get_json()
    push(client, "a", random_like(adapter, 10))
    push(client, "a", random_like(adapter, 11))
    assert client.get("/api/v1/gateway").get_json()["stale"] is True
    info = client.get("/api/v1/gateway?fresh=1").get_json()  # built at once, despite the interval
    assert info["stale"] is False and info["sources"] == {"a": 2} and info["version"] > first["version"]
    weights = client.get("/api/v1/gateway/weights?fresh=1")
    assert weights.headers["X-FedMoE-Version"] == str(info["version"])
    assert app.extensions["fedmoe"].gateway.builds == 2
    assert client.get("/api/v1/gateway?fresh=yes").status_code == 400


def test_a_restart_reuses_the_stored_gateway(make_app):
    app = make_app()
    put_expert(app.test_client(), "a", make_adapter(seed=1))
    version = app.test_client().get("/api/v1/gateway").get_json()["version"]
    app.extensions["fedmoe"].close()
    again = make_app()
    assert again.test_client().get("/api/v1/gateway").get_json()["version"] == version
    assert again.extensions["fedmoe"].gateway.builds == 0


@pytest.mark.parametrize("strategy, settings", [
    ("ties", {"density": 0.5, "rank": 3}),
    ("dare", {"p": 0.3, "seed": 7, "lam": 2.0, "rank": 3}),
    ("task_arithmetic", {"lam": 0.5, "rank": 3}),
    ("weighted_average", {"rank": 3}),
])
def test_strategy_settings_reach_the_merge(make_app, strategy, settings):
    client = make_app(gateway_strategy=strategy, gateway_config=settings).test_client()
    put_expert(client, "a", make_adapter(rank=2, seed=1))
    put_expert(client, "b", make_adapter(rank=2, seed=2))
    info = client.get("/api/v1/gateway").get_json()
    assert info["strategy"] == strategy and info["lora"]["rank"] == 3
    assert {k: info["config"][k] for k in settings} == settings
    assert info["truncation_error"] > 0  # rank 3 < 2 + 2: the rank setting was applied


def test_the_gateway_changes_with_its_settings(make_app, tmp_path):
    tensors = {}
    for density in (0.2, 0.9):
        client = make_app(data_dir=tmp_path / str(density), gateway_strategy="ties",
                          gateway_config={"density": density}).test_client()
        put_expert(client, "a", make_adapter(rank=2, seed=1))
        put_expert(client, "b", make_adapter(rank=2, seed=2))
        tensors[density] = client.get("/api/v1/gateway/weights").data
    assert tensors[0.2] != tensors[0.9]


@pytest.mark.parametrize("strategy, settings, message", [
    ("ties", {"p": 0.5}, "--gateway-config: unknown config key 'p' for merge 'ties'; valid keys: density, lam, rank"),
    ("ties", {"density": 0}, "--gateway-config: density must be in (0, 1], got 0"),
    ("dare", {"seed": "x"}, "--gateway-config: seed must be an integer, got 'x'"),
    ("weighted_average", {"lam": 2}, "valid keys: rank"),
])
def test_bad_settings_are_refused_at_start(tmp_path, strategy, settings, message):
    with pytest.raises(ValueError, match="--gateway-config") as error:
        CoordinatorConfig(data_dir=tmp_path, gateway_strategy=strategy, gateway_config=settings)
    assert message in str(error.value)
