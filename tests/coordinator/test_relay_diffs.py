"""A relay answers its workers' diff pulls (``?since=``) from the versions it holds, never over the long link.

A real root and a real relay, each served on a loopback port; every request the relay sends upstream is counted.
"""
from __future__ import annotations

import pytest
import torch

from compression import make_codec
from compression.wire import decode_update
from protocol.client import CoordinatorClient
from protocol.errors import NotFound
from protocol.tensors import dumps, loads, manifest_of
from tests.helpers import make_adapter, new_root_version, random_like, relay_fetches, relay_sites
from worker.adaptive import LinkEstimate
from worker.encoding import CodecChoice, PullSettings
from worker.pulling import ExpertPuller
from worker.sync_state import ExpertState


@pytest.fixture
def sites(tmp_path):
    """(root client as a worker, relay service, relay client as a worker, root URL)."""
    with relay_sites(tmp_path) as parts:
        yield parts


def relay_holds_0_1_3(at_root, relay, at_relay) -> None:
    """The root at version 3; the relay holding versions 0, 1 and 3 (never 2)."""
    assert at_relay.experts.pull("e1", worker_id="w1").version == 0
    new_root_version(at_root, 1)
    relay_fetches(relay)
    new_root_version(at_root, 2)  # v2 exists at the root but the relay never saw it
    new_root_version(at_root, 3)
    assert relay_fetches(relay) == 3 and relay.store.cached_versions("e1") == [0, 1, 3]


@pytest.fixture
def upstream_calls(sites, monkeypatch):
    _, relay, _, _ = sites
    calls: list[tuple[str, str]] = []
    original = relay.upstream.transport.request

    def counted(method, path, **kwargs):
        calls.append((method, path))
        return original(method, path, **kwargs)

    monkeypatch.setattr(relay.upstream.transport, "request", counted)
    return calls


def raw_get(client: CoordinatorClient, worker: str, **params):
    import requests

    return requests.get(f"{client.base_url}/api/v1/experts/e1/weights", params=params,
                        headers={"Authorization": f"Bearer {client.workers.token_of(worker)}",
                                 "X-FedMoE-Worker": worker}, timeout=30)


def test_a_diff_since_a_version_the_relay_holds_is_the_roots_answer_byte_for_byte(sites, upstream_calls):
    at_root, relay, at_relay, root_url = sites
    assert at_relay.experts.pull("e1", worker_id="w1").version == 0  # cached v0
    for seed in (1, 2):
        new_root_version(at_root, seed)
        relay_fetches(relay)
    assert relay.store.cached_versions("e1") == [0, 1, 2]
    upstream_calls.clear()
    for since, codec in ((0, "int8"), (1, "int8"), (0, None), (1, "int4"), (0, "topk+int8")):
        params = {"since": since} | ({"codec": codec} if codec else {})
        mine, roots = raw_get(at_relay, "w1", **params), raw_get(at_root, "w-root", **params)
        assert mine.status_code == roots.status_code == 200, mine.text
        assert mine.content == roots.content and len(mine.content) > 0
        assert mine.headers["X-FedMoE-Version"] == roots.headers["X-FedMoE-Version"] == "2"
    current = raw_get(at_relay, "w1", since=2, codec="int8")
    assert current.status_code == 304 and current.headers["X-FedMoE-Version"] == "2" and current.content == b""
    # it decodes to the current weights, as a worker decodes it
    v0 = at_root.experts.pull("e1", version=0).tensors
    v2 = at_root.experts.pull("e1").tensors
    payload, version = at_relay.experts.pull_diff("e1", 0, "fp16", worker_id="w1")
    delta = decode_update(payload, manifest_of(v0), make_codec("fp16", {}))
    assert version == 2 and all(torch.allclose(v0[k] + delta[k], v2[k], atol=1e-3) for k in v2)
    assert upstream_calls == []  # none of it crossed the long link
    assert relay.diff_bytes_served > 0 and relay.bytes_served >= relay.diff_bytes_served


def test_a_since_the_relay_does_not_hold_is_a_404_and_the_worker_pulls_full_weights_from_the_cache(
        sites, upstream_calls):
    at_root, relay, at_relay, root_url = sites
    relay_holds_0_1_3(at_root, relay, at_relay)
    v2 = at_root.experts.pull("e1", version=2).tensors
    upstream_calls.clear()

    missing = raw_get(at_relay, "w1", since=2, codec="int8")
    assert missing.status_code == 404 and missing.json()["error"]["details"]["reason"] == "diff_unavailable"
    assert raw_get(at_root, "w-root", since=2, codec="int8").status_code == 200  # the root could

    puller = ExpertPuller(at_relay, "e1", "w1", PullSettings(full_every=10), sync_budget=2.0)
    state = ExpertState(version=2, etag=None, pulled=v2, reference=v2, pulls=1)
    fetched = puller.fetch(state, CodecChoice("int8"))
    v3 = at_root.experts.pull("e1")
    assert fetched.diff_codec is None and fetched.version == 3 and fetched.etag == v3.etag
    assert all(torch.equal(fetched.weights[k], v3.tensors[k]) for k in v3.tensors)
    assert fetched.nbytes == len(dumps(v3.tensors))  # what the download estimate is fed: the full body, LAN-timed
    link = LinkEstimate()
    link.observe(fetched.nbytes, fetched.seconds)
    assert link.observed == 1
    assert upstream_calls == []  # the 404 and the full pull were both the relay's own
    assert relay.diffs_unavailable == 2  # the raw request and the worker's

    # and a version it holds is a diff again
    state = ExpertState(version=1, etag=None, pulled=at_root.experts.pull("e1", version=1).tensors, pulls=1)
    fetched = puller.fetch(state, CodecChoice("int8"))
    assert fetched.diff_codec == "int8" and fetched.version == 3
    assert all(torch.allclose(fetched.weights[k], v3.tensors[k], atol=0.05) for k in v3.tensors)
    assert upstream_calls == []


@pytest.mark.parametrize("params", [
    {"since": "abc"}, {"since": "-1"}, {"since": "1" * 19}, {"since": "0", "codec": "nope"},
    {"since": "0", "codec": "int8", "codec_config": "{not json"}, {"since": "0", "codec": "int8", "codec_config": "[1]"},
    {"since": "0", "codec": "topk", "codec_config": '{"ratio": 7}'}, {"since": "99"}])
def test_bad_diff_requests_are_the_roots_4xx_json_at_the_relay_with_nothing_sent_upstream(sites, upstream_calls,
                                                                                        params):
    at_root, relay, at_relay, root_url = sites
    assert at_relay.experts.pull("e1", worker_id="w1").version == 0
    relay_fetches(relay)
    upstream_calls.clear()
    mine, roots = raw_get(at_relay, "w1", **params), raw_get(at_root, "w-root", **params)
    assert 400 <= mine.status_code < 500 and mine.status_code == roots.status_code
    assert mine.json()["error"]["code"] == roots.json()["error"]["code"]
    if params["since"] != "99":  # a version newer than the cache's: the relay revalidates once before answering
        assert upstream_calls == []


def test_the_relay_keeps_a_bounded_history_on_disk_and_across_a_restart(sites):
    at_root, relay, at_relay, _ = sites
    relay.store.keep_previous = 2
    assert at_relay.experts.pull("e1", worker_id="w1").version == 0
    for seed in range(1, 6):
        new_root_version(at_root, seed)
        relay_fetches(relay)
    assert relay.store.cached_versions("e1") == [3, 4, 5]
    held = {relay.store.cached_version("e1", v).blob for v in (3, 4, 5)}
    assert set(relay.blobs.digests()) == held  # the blobs of versions 0-2 were deleted
    assert all(loads(relay.blobs.path(relay.store.cached_version("e1", v).blob).read_bytes()) for v in (3, 4))
    relay.store.close()
    from coordinator.relay.relay_store import RelayStore

    reopened = RelayStore(relay.relay_config.coordinator.data_dir / "relay.sqlite")
    try:
        assert reopened.cached_versions("e1") == [3, 4, 5]
        assert held <= reopened.referenced_blobs()  # a restart's orphan sweep keeps them
    finally:
        reopened.close()
        relay.store = RelayStore(relay.relay_config.coordinator.data_dir / "relay.sqlite")  # for the fixture's close


def test_pruned_history_versions_are_a_404_not_a_500(sites):
    at_root, relay, at_relay, _ = sites
    relay.store.keep_previous = 0
    assert at_relay.experts.pull("e1", worker_id="w1").version == 0
    new_root_version(at_root, 1)
    relay_fetches(relay)
    assert relay.store.cached_versions("e1") == [1]
    with pytest.raises(NotFound):
        at_relay.experts.pull_diff("e1", 0, "int8", worker_id="w1")


def test_a_full_pull_of_a_version_is_that_version_held_here_or_fetched_upstream_never_the_latest(
        sites, upstream_calls):
    at_root, relay, at_relay, root_url = sites
    relay_holds_0_1_3(at_root, relay, at_relay)
    upstream_calls.clear()
    for version in (0, 1, 3):  # held: from the relay's disk, the root's bytes and ETag for that version
        mine, roots = raw_get(at_relay, "w1", version=version), raw_get(at_root, "w-root", version=version)
        assert mine.status_code == roots.status_code == 200, mine.text
        assert mine.content == roots.content and mine.headers["ETag"] == roots.headers["ETag"]
        assert mine.headers["X-FedMoE-Version"] == str(version)
    assert upstream_calls == []
    assert raw_get(at_relay, "w1", version=1).content != raw_get(at_relay, "w1").content  # v1 is not v3

    mine, roots = raw_get(at_relay, "w1", version=2), raw_get(at_root, "w-root", version=2)  # not held: upstream
    assert mine.status_code == 200 and mine.content == roots.content and mine.headers["ETag"] == roots.headers["ETag"]
    assert mine.headers["X-FedMoE-Version"] == "2" and len(upstream_calls) == 1
    pulled = at_relay.experts.pull("e1", version=2, worker_id="w1")  # a client checks the ETag against the bytes
    fetched, bodies = relay.cache.bytes_fetched, []
    original = relay.upstream.version_body
    relay.upstream.version_body = lambda *a: bodies.append(original(*a)[0]) or original(*a)
    assert pulled.version == 2 and at_relay.experts.pull("e1", etag=pulled.etag, version=2, worker_id="w1").tensors \
        is None  # If-None-Match: passed upstream, whose 304 comes back without a body over the long link
    relay.upstream.version_body = original
    assert bodies == [None] and relay.cache.bytes_fetched == fetched
    assert raw_get(at_relay, "w1", version=2).content == roots.content
    assert relay.cache.bytes_fetched == fetched + len(roots.content)  # a body fetched counts as fetched
    assert relay.store.cached_versions("e1") == [0, 1, 3]  # nothing kept of it

    mine, roots = raw_get(at_relay, "w1", version=99), raw_get(at_root, "w-root", version=99)
    assert mine.status_code == roots.status_code == 404 and mine.json() == roots.json()


@pytest.mark.parametrize("value", ["abc", "-1", "1" * 19, "", " 1", "1.0"])
def test_a_bad_version_is_the_roots_400_at_the_relay_with_nothing_sent_upstream(sites, upstream_calls, value):
    at_root, relay, at_relay, root_url = sites
    assert at_relay.experts.pull("e1", worker_id="w1").version == 0
    relay_fetches(relay)
    upstream_calls.clear()
    mine, roots = raw_get(at_relay, "w1", version=value), raw_get(at_root, "w-root", version=value)
    assert mine.status_code == roots.status_code == 400 and mine.json() == roots.json()
    assert upstream_calls == []


def test_a_diff_pull_of_a_version_is_to_that_version_at_the_root_and_the_relay_alike(sites, upstream_calls):
    """``?since=S&version=N`` is version N minus version S, byte for byte the root's answer; before, both the root
    and the relay sent the current version's diff instead (under its own version header)."""
    at_root, relay, at_relay, _ = sites
    relay_holds_0_1_3(at_root, relay, at_relay)
    upstream_calls.clear()
    for since, version in ((0, 1), (1, 0), (0, 3)):
        mine = raw_get(at_relay, "w1", since=since, version=version, codec="fp16")
        roots = raw_get(at_root, "w-root", since=since, version=version, codec="fp16")
        assert mine.status_code == roots.status_code == 200 and mine.content == roots.content
        assert mine.headers["X-FedMoE-Version"] == roots.headers["X-FedMoE-Version"] == str(version)
        old, new = (at_root.experts.pull("e1", version=v).tensors for v in (since, version))
        delta = decode_update(mine.content, manifest_of(old), make_codec("fp16", {}))
        assert all(torch.allclose(old[k] + delta[k], new[k], atol=1e-3) for k in new)
    assert upstream_calls == []
    same = raw_get(at_relay, "w1", since=1, version=1, codec="fp16")
    assert same.status_code == 304 and same.headers["X-FedMoE-Version"] == "1"
    missing = raw_get(at_relay, "w1", since=0, version=2, codec="fp16")  # v2 never reached the relay
    assert missing.status_code == 404 and missing.json()["error"]["details"]["reason"] == "diff_unavailable"
    assert raw_get(at_root, "w-root", since=0, version=99, codec="fp16").status_code == 404


def test_a_full_pull_of_a_version_at_a_site_model_relay_is_the_roots_version_not_the_sites_weights(tmp_path):
    with relay_sites(tmp_path, site_model=True) as (at_root, relay, at_relay, _):
        assert at_relay.experts.pull("e1", worker_id="w1").version == 0
        new_root_version(at_root, 1)
        relay_fetches(relay)
        at_relay.updates.push("e1", dumps(random_like(make_adapter(), 5)), {
            "update_id": "u1", "base_version": 1, "num_samples": 3, "worker_id": "w1"})
        site = raw_get(at_relay, "w1")  # version 1 plus the site's update
        for version in (0, 1):
            mine, roots = raw_get(at_relay, "w1", version=version), raw_get(at_root, "w-root", version=version)
            assert mine.status_code == 200 and mine.content == roots.content
            assert mine.headers["X-FedMoE-Version"] == str(version) and mine.headers["ETag"] == roots.headers["ETag"]
        assert site.headers["X-FedMoE-Version"] == "1" and site.content != raw_get(at_root, "w-root").content
