"""Durability: a restart on the same data dir restores everything exactly."""
import torch

from coordinator.blobs import BlobStore
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
    blobs: BlobStore = app.extensions["fedmoe"].blobs
    digests = set(blobs.digests())
    assert len(digests) == 2  # versions 0 and 1; the applied payload is gone
    assert all(blobs.verify(d) for d in digests)
    app.extensions["fedmoe"].close()

    orphan = blobs.put_bytes(b"written just before a crash")
    (blobs.tmp_dir / "half.part").write_bytes(b"half")
    app = make_app()
    assert set(app.extensions["fedmoe"].blobs.digests()) == digests
    assert orphan not in set(app.extensions["fedmoe"].blobs.digests())
    assert list(blobs.tmp_dir.iterdir()) == []
