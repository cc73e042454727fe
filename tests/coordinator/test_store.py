"""Durability: a restart on the same data dir restores everything exactly."""
import pytest
import torch

from coordinator.storage.blobs import BlobStore
from coordinator.storage.manifest import StaleAggregation
from protocol.tensors import loads
from tests.helpers import make_adapter, push, put_expert, random_like, update_meta


def test_restart_restores_experts_versions_and_pending_updates(make_app):
    app = make_app(aggregation="fedbuff", buffer_size=3, staleness_decay=0.0)
    client = app.test_client()
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    deltas = [random_like(adapter, i) for i in range(5)]
    metas = [update_meta(num_samples=1) for _ in deltas]
    for d, m in zip(deltas[:4], metas[:4]):
        push(client, "e", d, m)  # 3 applied as version 1, one pending
    before = client.get("/api/v1/experts/e").get_json()
    weights_before = client.get("/api/v1/experts/e/weights").data
    app.extensions["fedmoe"].close()

    client = make_app(aggregation="fedbuff", buffer_size=3, staleness_decay=0.0).test_client()
    after = client.get("/api/v1/experts/e").get_json()
    assert after == before and after["version"] == 1 and after["pending_updates"] == 1
    assert client.get("/api/v1/experts/e/weights").data == weights_before
    # the pending update survived: the retry of it is recognised, two more complete the buffer
    assert push(client, "e", deltas[3], metas[3]).status_code == 200
    push(client, "e", deltas[4], metas[4])
    push(client, "e", deltas[0], update_meta(num_samples=1))
    got = loads(client.get("/api/v1/experts/e/weights").data)
    expected = {k: adapter[k] + sum(d[k] for d in deltas[:3]) / 3 + (deltas[3][k] + deltas[4][k] + deltas[0][k]) / 3
                for k in adapter}
    assert client.get("/api/v1/experts/e").get_json()["version"] == 2
    assert all(torch.allclose(got[k], expected[k], atol=1e-6) for k in adapter)


def test_pending_updates_are_applied_at_start_when_policy_allows(make_app):
    """A crash between recording an update and applying it: the next start applies it."""
    app = make_app(aggregation="fedbuff", buffer_size=2)
    client = app.test_client()
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    push(client, "e", random_like(adapter, 1))
    app.extensions["fedmoe"].close()
    client = make_app(aggregation="fedasync").test_client()  # restarted with K = 1
    assert client.get("/api/v1/experts/e").get_json()["version"] == 1


def test_applied_payloads_and_orphans_are_removed_and_blobs_match_hashes(make_app, tmp_path):
    app = make_app()
    client = app.test_client()
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    push(client, "e", random_like(adapter, 1))
    # Background gateway builds write blobs too: wait for the one of version 1 and let it finish, so
    # the restart below has nothing to build.
    assert client.get("/api/v1/gateway").get_json()["stale"] is False
    app.extensions["fedmoe"].gateway.close()
    blobs: BlobStore = app.extensions["fedmoe"].store._blobs
    digests = set(blobs.digests())
    gateways = {r["blob"] for r in app.extensions["fedmoe"].store._rows._all("SELECT blob FROM gateways")}
    assert len(digests - gateways) == 2  # versions 0 and 1; the applied payload is gone
    assert all(blobs.verify(d) for d in digests)
    app.extensions["fedmoe"].close()

    orphan = blobs.put_bytes(b"written just before a crash")
    (blobs.tmp_dir / "half.part").write_bytes(b"half")
    app = make_app()
    assert set(app.extensions["fedmoe"].store._blobs.digests()) == digests
    assert orphan not in set(app.extensions["fedmoe"].store._blobs.digests())
    assert list(blobs.tmp_dir.iterdir()) == []


def test_same_update_id_with_other_bytes_is_409_and_the_first_body_stays(client):
    """A replay must resend the same body: retries stay idempotent 200s, a reuse is refused."""
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    meta = update_meta(num_samples=3)
    first, other = random_like(adapter, 1), random_like(adapter, 2)
    assert push(client, "e", first, meta).status_code == 202
    assert push(client, "e", first, meta).status_code == 200
    r = push(client, "e", other, meta)
    assert r.status_code == 409 and r.get_json()["error"]["details"] == {"update_id": meta["update_id"]}
    info = client.get("/api/v1/experts/e").get_json()
    assert info["version"] == 1 and info["samples_seen"] == 3
    got = loads(client.get("/api/v1/experts/e/weights").data)
    assert all(torch.allclose(got[k], adapter[k] + first[k]) for k in adapter)


def test_replay_check_survives_a_restart(make_app):
    app = make_app(aggregation="fedbuff", buffer_size=2)
    adapter = make_adapter()
    put_expert(app.test_client(), "e", adapter)
    meta = update_meta()
    push(app.test_client(), "e", random_like(adapter, 1), meta)  # pending: its blob is still there
    applied = update_meta()
    push(app.test_client(), "e", random_like(adapter, 3), applied)  # K = 2: both applied, blobs dropped
    app.extensions["fedmoe"].close()
    client = make_app(aggregation="fedbuff", buffer_size=2).test_client()
    assert push(client, "e", random_like(adapter, 1), meta).status_code == 200
    assert push(client, "e", random_like(adapter, 2), meta).status_code == 409
    assert push(client, "e", random_like(adapter, 2), applied).status_code == 409


def test_a_second_process_on_the_same_data_dir_cannot_apply_an_update_twice(make_app):
    """Two coordinators on one data dir (an orphaned server worker after a kill -9 of its parent):
    the one whose pending list went stale drops its step instead of applying the updates again."""
    first = make_app(aggregation="fedbuff", buffer_size=2)
    second = make_app(aggregation="fedbuff", buffer_size=2)
    adapter = make_adapter()
    put_expert(first.test_client(), "e", adapter)
    push(first.test_client(), "e", random_like(adapter, 1), update_meta(num_samples=5))
    c2 = second.extensions["fedmoe"]
    stale = c2.store.rows.pending_updates("e")
    push(first.test_client(), "e", random_like(adapter, 2), update_meta(num_samples=7))  # first applies both
    weights = first.test_client().get("/api/v1/experts/e/weights").data

    assert len(stale) == 1 and c2.steps.apply("e", stale + stale) is False
    with pytest.raises(StaleAggregation):  # the commit itself refuses a stale step
        c2.store._rows.commit_version("e", 2, c2.store.weights("e").digest, stale, None)
    info = first.test_client().get("/api/v1/experts/e").get_json()
    assert info["version"] == 1 and info["samples_seen"] == 12 and info["updates_applied"] == 2
    assert first.test_client().get("/api/v1/experts/e/weights").data == weights
    first.extensions["fedmoe"].gateway.close()  # its background gateway builds write blobs too: let them finish
    assert set(c2.store._blobs.digests()) == c2.store._rows.referenced_blobs()


def test_commit_refuses_a_step_whose_base_version_moved(make_app):
    app = make_app(aggregation="fedbuff", buffer_size=5)
    adapter = make_adapter()
    put_expert(app.test_client(), "e", adapter)
    push(app.test_client(), "e", random_like(adapter, 1))
    c = app.extensions["fedmoe"]
    pending = c.store.rows.pending_updates("e")
    with pytest.raises(StaleAggregation):
        c.store._rows.commit_version("e", 2, c.store.weights("e").digest, pending, None)  # expert is at 0, not 1
    assert c.store.rows.pending_count("e") == 1 and c.store.rows.expert("e").version == 0
