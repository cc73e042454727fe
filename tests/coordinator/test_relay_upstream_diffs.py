"""``--upstream-pull-compression``: a relay fetches each new root version as a compressed diff since its cached
one (a full fetch every ``full_every``-th time) and serves the result under an ETag of its own bytes. A real root and a real relay on loopback ports; every request the relay sends upstream is counted.
"""
from __future__ import annotations

import pytest
import torch

from coordinator.relay.upstream import DiffPulls
from tests.helpers import new_root_version, relay_fetches, relay_sites


@pytest.fixture
def sites(tmp_path):
    """(root client as a worker, relay service, relay client as a worker, the upstream requests the relay sent)."""
    with relay_sites(tmp_path, upstream_diffs=DiffPulls("fp16", full_every=3)) as (at_root, relay, at_relay, _):
        calls: list[str] = []
        original = relay.upstream.transport.request

        def counted(method, path, **kwargs):
            calls.append(f"{method} {path}" + ("?since" if "since" in (kwargs.get("params") or {}) else ""))
            return original(method, path, **kwargs)

        relay.upstream.transport.request = counted
        yield at_root, relay, at_relay, calls


def test_new_versions_come_as_diffs_with_a_full_fetch_every_third_time(sites):
    at_root, relay, at_relay, calls = sites
    relay_fetches(relay)  # the first fetch of a process is a full one
    kinds = []
    for seed in range(1, 6):
        version = new_root_version(at_root, seed)
        calls.clear()
        relay_fetches(relay)
        weights = [c for c in calls if "/weights" in c]
        kinds.append("diff" if weights == ["GET /experts/e1/weights?since"] else "full")
        pulled = at_relay.experts.pull("e1", worker_id="w1")
        exact = at_root.experts.pull("e1", worker_id="w-root")
        assert pulled.version == exact.version == version
        # the root's weights within fp16's error of the diffs since the last full fetch, under an ETag of their own
        assert all(torch.allclose(pulled.tensors[k], exact.tensors[k], rtol=0, atol=2e-3) for k in exact.tensors)
        if kinds[-1] == "diff":
            assert pulled.etag != exact.etag
            assert any(not torch.equal(pulled.tensors[k], exact.tensors[k]) for k in exact.tensors)
        else:
            assert pulled.etag == exact.etag
            assert all(torch.equal(pulled.tensors[k], exact.tensors[k]) for k in exact.tensors)
        assert at_relay.experts.pull("e1", etag=pulled.etag, worker_id="w1").tensors is None  # 304 on our ETag
    assert kinds == ["diff", "diff", "full", "diff", "diff"]
    assert relay.cache.diff_fetches == 4 and relay.cache.upstream_fetches == 2


def test_nothing_new_costs_no_body_and_a_pruned_base_falls_back_to_a_full_fetch(sites, monkeypatch):
    at_root, relay, _, calls = sites
    relay_fetches(relay)
    calls.clear()
    relay_fetches(relay)  # the root is still at version 0: an empty diff answer, nothing stored
    assert relay.cache.diff_fetches == 0 and relay.cache.known("e1").version == 0
    new_root_version(at_root, 1)
    from protocol.errors import NotFound

    def gone(*args, **kwargs):
        raise NotFound("version 0 is no longer kept")

    monkeypatch.setattr(relay.upstream.experts, "pull_diff", gone)
    relay_fetches(relay)
    assert relay.cache.known("e1").version == 1 and relay.cache.upstream_fetches == 2


def test_bad_settings_are_refused_with_the_flag_named():
    from compression.errors import CompressionError

    with pytest.raises(CompressionError, match="unknown codec"):
        DiffPulls("nope")
    with pytest.raises(ValueError, match="--upstream-full-pull-every must be >= 1"):
        DiffPulls("int8", full_every=0)

