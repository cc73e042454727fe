"""fedasync's mixing weight: by default 1 / the N workers on the expert, so N workers' updates add up to their mean,
with staleness up to N - 1 on time (Xie et al.'s hinge); ``--async-alpha 1`` keeps the original tool's rule."""
import time

import pytest
import torch

from coordinator.aggregation import AGGREGATORS, AggregationParams, Update, staleness_weight
from coordinator.config import CoordinatorConfig, _async_alpha
from coordinator.liveness import active_workers, workers_on_expert
from coordinator.relay_registry import FRESH_REPORT_SECONDS
from protocol.tensors import loads
from tests.helpers import FINGERPRINT, make_adapter, push, put_expert, random_like, relay_join_token, update_meta

BASE = {"id": "tiny-test", "fingerprint": FINGERPRINT}


def register(client, worker_id: str, specialty: str) -> None:
    r = client.post("/api/v1/workers", json={"worker_id": worker_id, "specialty": specialty, "base_model": BASE,
                                              "sync_interval": 10})
    assert r.status_code == 200


def pushed_step(client, name: str, seed: int, base_version: int | None = None) -> tuple[dict, dict]:
    """Push one update to ``name`` from ``base_version`` (default: its current version); (weights before, delta),
    weights after via weights()."""
    before = weights(client, name)
    delta = random_like(before, seed)
    version = client.get(f"/api/v1/experts/{name}").get_json()["version"] if base_version is None else base_version
    assert push(client, name, delta, update_meta(base_version=version)).status_code == 202
    return before, delta


def moved_by(client, name: str, before: dict, delta: dict) -> float:
    """The factor f with weights now = before + f * delta (checked to hold for every tensor)."""
    after = weights(client, name)
    key = next(iter(before))
    factor = float(((after[key] - before[key]) / delta[key]).flatten()[0])
    assert all(torch.allclose(after[k], before[k] + factor * delta[k], atol=1e-6) for k in before)
    return factor


def weights(client, name: str) -> dict[str, torch.Tensor]:
    return loads(client.get(f"/api/v1/experts/{name}/weights").data)


def test_fedasync_mixes_each_update_in_at_alpha():
    current = {"w": torch.ones(2, 3)}
    params = AggregationParams(server_lr=0.5, staleness_decay=0.0, alpha=0.25)
    result = AGGREGATORS["fedasync"](current, [Update({"w": torch.full((2, 3), 8.0)}, 1, 0)], params)
    assert torch.equal(result["w"], torch.full((2, 3), 1.0 + 0.25 * 0.5 * 8.0))


def test_by_default_each_update_counts_one_over_the_workers_on_its_expert(client):
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


def test_staleness_weight_with_grace_is_xie_et_al_hinge():
    assert [staleness_weight(s, 0.1, grace=5) for s in (0, 3, 5)] == [1.0, 1.0, 1.0]  # on time: not discounted
    assert staleness_weight(7, 0.1, grace=5) == pytest.approx(1 / 1.2)  # 2 versions late
    assert staleness_weight(7, 0.1) == pytest.approx(1 / 1.7)  # grace 0: the original rule


def test_an_update_a_round_old_counts_one_over_n_whole(client):
    """Three workers pushed from version 0: the third is 2 versions old, which is on time with 3 workers (the other
    two pushed while it trained): 1/3 of it, not 1/3 x 1/(1 + 0.1 x 2) as with the original staleness rule."""
    put_expert(client, "e", make_adapter())
    for worker_id in ("w1", "w2", "w3"):
        register(client, worker_id, "e")
    factors = []
    for seed in (1, 2, 3):
        before, delta = pushed_step(client, "e", seed, base_version=0)
        factors.append(moved_by(client, "e", before, delta))
    assert factors == pytest.approx([1 / 3] * 3, abs=1e-5)
    before, delta = pushed_step(client, "e", 4, base_version=0)  # 3 behind with 3 workers: 1 version late
    assert moved_by(client, "e", before, delta) == pytest.approx(1 / 3 / 1.1, abs=1e-5)


def test_a_lone_worker_is_not_slowed_and_keeps_the_original_staleness_rule(client):
    put_expert(client, "e", make_adapter())
    register(client, "w1", "e")
    before, delta = pushed_step(client, "e", 1)
    assert moved_by(client, "e", before, delta) == pytest.approx(1.0, abs=1e-5)  # applied at once, whole
    before, delta = pushed_step(client, "e", 2, base_version=0)  # 1 version behind: discounted as always
    assert moved_by(client, "e", before, delta) == pytest.approx(1 / 1.1, abs=1e-5)


def test_a_fixed_async_alpha_keeps_the_original_staleness_rule(make_app):
    client = make_app(async_alpha=0.5).test_client()
    put_expert(client, "e", make_adapter())
    for worker_id in ("w1", "w2"):
        register(client, worker_id, "e")
    pushed_step(client, "e", 1)
    before, delta = pushed_step(client, "e", 2, base_version=0)
    assert moved_by(client, "e", before, delta) == pytest.approx(0.5 / 1.1, abs=1e-5)


def test_each_version_records_the_alpha_and_the_workers_counted(client):
    put_expert(client, "e", make_adapter())
    for worker_id in ("w1", "w2"):
        register(client, worker_id, "e")
    pushed_step(client, "e", 1)
    detail = client.get("/api/v1/events?kind=version_applied").get_json()["events"][0]["detail"]
    assert {k: detail[k] for k in ("alpha", "staleness_grace", "workers_counted", "workers_alive")} == {
        "alpha": 0.5, "staleness_grace": 1, "workers_counted": 2, "workers_alive": 2}


def test_workers_between_pushes_still_count_until_gone():
    """A worker is heard from when it syncs, after the optimiser step in progress: one whose steps take longer than
    3 sync intervals looked dead between pushes, and counting only the alive ones made the others' updates count
    1/2 instead of 1/6. Workers stale (within 20 syncs, 5 min at least) count; gone ones do not."""
    now = 1000.0
    rows = [{"specialty": "e", "last_seen": now - 5, "sync_interval": 30},      # alive
            {"specialty": "e", "last_seen": now - 120, "sync_interval": 30},    # mid-step: 4 syncs silent, stale
            {"specialty": "e", "last_seen": now - 590, "sync_interval": 30},    # stale: within 20 syncs (600 s)
            {"specialty": "e", "last_seen": now - 601, "sync_interval": 30},    # gone
            {"specialty": "e", "last_seen": now - 299, "sync_interval": 1},     # stale: 5 minutes at least
            {"specialty": "f", "last_seen": now, "sync_interval": 30}]
    assert workers_on_expert(rows, "e", now) == 4 and workers_on_expert(rows, "g", now) == 0
    assert active_workers(rows, "e", now) == 1  # what GET /workers shows as alive: unchanged


def test_get_workers_shows_as_alive_only_those_heard_from_within_3_syncs():
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


def test_a_relay_forwarding_the_expert_counts_as_one_more_source(make_app):
    """A relay's batch is its site's mean: with one direct worker and one relay reporting two workers of the expert,
    each update counts 1/2 (the root used to count only its own workers: alpha 1, the sum of the two means)."""
    app = make_app()
    client = app.test_client()
    put_expert(client, "e", make_adapter())
    register(client, "direct", "e")
    body = {"relay_id": "site-a", "url": "http://10.0.0.2:5001", "base_model": BASE}
    relay = app.test_client(token=app.test_client(token=relay_join_token(app.extensions["fedmoe"].config.data_dir))
                            .post("/api/v1/relays", json=body).get_json()["token"])
    site = [{"worker_id": "s1", "specialty": "e"}, {"worker_id": "s2", "specialty": "e"},
            {"worker_id": "s3", "specialty": "other", "status": "alive"}]
    assert relay.post("/api/v1/relays/site-a/report", json={"workers": site}).status_code == 200
    before, delta = pushed_step(client, "e", 1)
    assert moved_by(client, "e", before, delta) == pytest.approx(0.5, abs=1e-5)
    detail = client.get("/api/v1/events?kind=version_applied").get_json()["events"][0]["detail"]
    assert (detail["workers_counted"], detail["relays_counted"], detail["alpha"]) == (1, 1, 0.5)
    registry = app.extensions["fedmoe"].relays
    assert registry.sources_on("other") == 1 and registry.sources_on("nobody's") == 0
    assert registry.sources_on("e", now=time.time() + FRESH_REPORT_SECONDS + 1) == 0  # a relay long silent: gone
    relay.post("/api/v1/relays/site-a/report", json={"workers": [{"worker_id": "s1", "specialty": "e",
                                                                    "status": "gone"}]})
    assert registry.sources_on("e") == 0  # its only worker of "e" is gone
