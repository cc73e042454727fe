"""``--site-model``: a relay serves its workers the root's weights plus the site's updates not yet in them, forwards
their weighted sum, and drops what a new root version includes (coordinator/relay/site.py). A real root and a real
relay on loopback ports; the expected weights are computed here from the deltas pushed."""
from __future__ import annotations

import pytest
import torch

from coordinator.aggregation.base import staleness_weight
from coordinator.relay.site import SiteModel
from protocol.errors import NotFound
from protocol.tensors import dumps
from tests.helpers import FINGERPRINT, make_adapter, new_root_version, random_like, relay_fetches, relay_sites

BASE = {"id": "m", "fingerprint": FINGERPRINT}


@pytest.fixture
def site(tmp_path):
    with relay_sites(tmp_path, site_model=True) as (at_root, relay, at_relay, _):
        at_relay.workers.register("w2", "e1", BASE)
        relay_fetches(relay)
        yield at_root, relay, at_relay


def push(client, worker: str, seed: int, base_version: int = 0) -> dict[str, torch.Tensor]:
    delta = random_like(make_adapter(), seed)
    client.updates.push("e1", dumps(delta), {"update_id": f"{worker}-{seed}", "base_version": base_version,
                                            "num_samples": 4, "worker_id": worker})
    return delta


def plus(weights: dict[str, torch.Tensor], *terms: tuple[dict[str, torch.Tensor], float]) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in weights.items()}
    for delta, weight in terms:
        for k in out:
            out[k] += weight * delta[k]
    return out


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)


def test_workers_pull_their_sites_updates_before_they_are_forwarded(site):
    at_root, relay, at_relay = site
    root = at_root.experts.pull("e1", worker_id="w-root")
    first = at_relay.experts.pull("e1", worker_id="w1")
    assert first.version == 0 and close(first.tensors, root.tensors)
    at_relay.experts.pull("e1", worker_id="w2")
    d1 = push(at_relay, "w1", 1)
    seen_by_w2 = at_relay.experts.pull("e1", worker_id="w2")
    # w1's step is in w2's next pull, under the root's version number and an ETag of the site's own bytes
    assert seen_by_w2.version == 0 and seen_by_w2.etag != root.etag
    assert close(seen_by_w2.tensors, plus(root.tensors, (d1, 0.5)))  # w1 and w2 are the site's workers: 1/2 each
    assert at_relay.experts.pull("e1", etag=seen_by_w2.etag, worker_id="w2").tensors is None  # 304 on the site's ETag
    d2 = push(at_relay, "w2", 2)  # w2 pulled after d1: nothing it has not seen
    # w1 last pulled before d1 and d2: its update is two site changes old, one past the grace of N - 1
    d3 = push(at_relay, "w1", 3)
    expected = plus(root.tensors, (d1, 0.5), (d2, 0.5), (d3, staleness_weight(2, 0.1, grace=1) / 2))
    assert close(at_relay.experts.pull("e1", worker_id="w1").tensors, expected)
    assert at_root.experts.get("e1")["version"] == 0  # nothing forwarded yet


def test_a_batch_is_the_weighted_sum_and_the_new_root_version_replaces_it(site):
    at_root, relay, at_relay = site
    root = at_root.experts.pull("e1", worker_id="w-root").tensors
    at_relay.experts.pull("e1", worker_id="w1")
    at_relay.experts.pull("e1", worker_id="w2")
    d1, d2 = push(at_relay, "w1", 1), push(at_relay, "w2", 2)
    assert relay.forwarder.flush() == 1
    # the root (FedAsync, staleness 0, one source) added the site's progress in full: the batch is the site's
    # weighted sum, in which its two workers' updates from the same weights count 1/2 each (w2's is one site change
    # old: within the grace of N - 1), so together they move the expert by their mean
    v1 = at_root.experts.pull("e1", worker_id="w-root")
    assert v1.version == 1 and close(v1.tensors, plus(root, (d1, 0.5), (d2, 0.5)))
    # until the relay holds version 1 its workers still see the batch, on version 0
    before = at_relay.experts.pull("e1", worker_id="w1")
    assert before.version == 0 and close(before.tensors, v1.tensors)
    relay_fetches(relay)
    after = at_relay.experts.pull("e1", worker_id="w1")
    # version 1 includes the batch: nothing is owed, the site's weights are the root's (HierFAVG's reset)
    assert after.version == 1 and all(torch.equal(after.tensors[k], v1.tensors[k]) for k in v1.tensors)


def test_a_batch_a_fedbuff_root_holds_back_stays_owed_until_a_version_includes_it(tmp_path):
    with relay_sites(tmp_path, root={"aggregation": "fedbuff", "buffer_size": 2}, site_model=True) as (
            at_root, relay, at_relay, _):
        relay_fetches(relay)
        root = at_root.experts.pull("e1", worker_id="w-root").tensors
        at_relay.experts.pull("e1", worker_id="w1")
        d1 = push(at_relay, "w1", 1)
        relay.forwarder.flush()  # buffered at the root (one of two): no applied_version yet
        assert at_root.experts.get("e1")["version"] == 0
        relay_fetches(relay)
        # w1 is this site's only worker of e1: its update counts whole
        assert close(at_relay.experts.pull("e1", worker_id="w1").tensors, plus(root, (d1, 1.0)))
        assert new_root_version(at_root, 7) == 1  # the buffer's second update: version 1 holds both
        relay_fetches(relay)
        pulled = at_relay.experts.pull("e1", worker_id="w1")
        v1 = at_root.experts.pull("e1", worker_id="w-root")
        # the relay asked the root which version applied its batch: 1, so nothing is owed any more
        assert pulled.version == 1 and all(torch.equal(pulled.tensors[k], v1.tensors[k]) for k in v1.tensors)
        assert relay.site._sites["e1"].pending == []


def test_diff_pulls_are_refused_so_workers_pull_the_sites_weights_in_full(site):
    _, relay, at_relay = site
    with pytest.raises(NotFound, match="pull them in full"):
        at_relay.experts.pull_diff("e1", 0, "int8", worker_id="w1")
    assert relay.diffs_unavailable == 1


def test_after_a_restart_the_site_model_is_rebuilt_from_the_queue(site):
    at_root, relay, at_relay = site
    root = at_root.experts.pull("e1", worker_id="w-root").tensors
    at_relay.experts.pull("e1", worker_id="w1")
    d1, d2 = push(at_relay, "w1", 1), push(at_relay, "w2", 2)  # w2 never pulled: staleness 0, 1/2
    fresh = SiteModel(relay.store, relay.blobs, relay.cache.get, lambda update_id: None, 0.1)
    entry, body = fresh.weights("e1", None)
    from protocol.tensors import loads

    assert entry.version == 0 and close(loads(body), plus(root, (d1, 0.5), (d2, 0.5)))

