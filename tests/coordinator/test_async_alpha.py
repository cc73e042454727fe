"""fedasync's mixing weight: by default 1 / the workers alive on the expert, so N workers' updates add up to
their mean; ``--async-alpha 1`` keeps the original tool's full-weight rule."""
import pytest
import torch

from coordinator.aggregation import AGGREGATORS, AggregationParams, Update
from coordinator.config import CoordinatorConfig, _async_alpha
from coordinator.liveness import active_workers
from protocol.tensors import loads
from tests.helpers import FINGERPRINT, make_adapter, push, put_expert, random_like, update_meta

BASE = {"id": "tiny-test", "fingerprint": FINGERPRINT}


def register(client, worker_id: str, specialty: str) -> None:
    r = client.post("/api/v1/workers", json={"worker_id": worker_id, "specialty": specialty, "base_model": BASE,
                                              "sync_interval": 10})
    assert r.status_code == 200


def pushed_step(client, name: str, seed: int) -> tuple[dict, dict]:
    """Push one update to ``name`` from its current version; (weights before, delta), weights after via weights()."""
    before = weights(client, name)
    delta = random_like(before, seed)
    version = client.get(f"/api/v1/experts/{name}").get_json()["version"]
    assert push(client, name, delta, update_meta(base_version=version)).status_code == 202
    return before, delta


def weights(client, name: str) -> dict[str, torch.Tensor]:
    return loads(client.get(f"/api/v1/experts/{name}/weights").data)


def test_fedasync_mixes_each_update_in_at_alpha():
    current = {"w": torch.ones(2, 3)}
    params = AggregationParams(server_lr=0.5, staleness_decay=0.0, alpha=0.25)
    result = AGGREGATORS["fedasync"](current, [Update({"w": torch.full((2, 3), 8.0)}, 1, 0)], params)
    assert torch.equal(result["w"], torch.full((2, 3), 1.0 + 0.25 * 0.5 * 8.0))


def test_by_default_each_update_counts_one_over_the_workers_alive_on_its_expert(client):
    put_expert(client, "e", make_adapter())
    put_expert(client, "other", make_adapter())
    for worker_id, specialty in (("w1", "e"), ("w2", "e"), ("w3", "e"), ("x1", "other")):
        register(client, worker_id, specialty)
    before, delta = pushed_step(client, "e", 1)
    after = weights(client, "e")
    assert all(torch.allclose(after[k], before[k] + delta[k] / 3, atol=1e-6) for k in before)
    before, delta = pushed_step(client, "other", 2)  # alone on its expert: the whole update, as before
    after = weights(client, "other")
    assert all(torch.allclose(after[k], before[k] + delta[k], atol=1e-6) for k in before)


def test_async_alpha_one_is_the_original_full_weight_rule(make_app):
    client = make_app(async_alpha=1.0).test_client()
    put_expert(client, "e", make_adapter())
    for worker_id in ("w1", "w2", "w3"):
        register(client, worker_id, "e")
    before, delta = pushed_step(client, "e", 1)
    after = weights(client, "e")
    assert all(torch.allclose(after[k], before[k] + delta[k], atol=1e-6) for k in before)


def test_only_alive_workers_of_the_expert_count():
    now = 1000.0
    rows = [{"specialty": "e", "last_seen": now - 5, "sync_interval": 10},      # alive
            {"specialty": "e", "last_seen": now - 31, "sync_interval": 10},     # stale: finished or gone
            {"specialty": "e", "last_seen": now - 100, "sync_interval": 60},    # alive: it syncs every minute
            {"specialty": "f", "last_seen": now, "sync_interval": 10}]
    assert active_workers(rows, "e", now) == 2 and active_workers(rows, "g", now) == 0


@pytest.mark.parametrize("text, expected", [("auto", None), ("AUTO", None), ("0.5", 0.5), ("1", 1.0)])
def test_async_alpha_flag_values(text, expected):
    assert _async_alpha(text) == expected


@pytest.mark.parametrize("text, words", [("0", "(0, 1]"), ("1.5", "(0, 1]"), ("half", "a number")])
def test_bad_async_alpha_names_the_flag(text, words):
    with pytest.raises(ValueError, match="--async-alpha") as info:
        _async_alpha(text)
    assert words in str(info.value)
    with pytest.raises(ValueError, match="--async-alpha"):
        CoordinatorConfig(async_alpha=0.0)
