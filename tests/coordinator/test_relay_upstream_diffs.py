"""``--upstream-pull-compression``: a relay fetches each new root version as a compressed diff since its cached
one (a full fetch every ``full_every``-th time), serves the result under an ETag of its own bytes, and builds its
batches on it. A real root and a real relay on loopback ports; every request the relay sends upstream is counted.
"""
from __future__ import annotations

import threading

import pytest
import torch
from werkzeug.serving import make_server

from coordinator.app import create_app
from coordinator.config import CoordinatorConfig
from coordinator.relay.api import create_relay_app
from coordinator.relay.forwarder import ForwardPolicy
from coordinator.relay.service import RelayConfig
from coordinator.relay.upstream import DiffPulls
from protocol.client import CoordinatorClient
from protocol.tensors import dumps
from tests.helpers import FINGERPRINT, expert_spec, make_adapter, random_like

BASE = {"id": "m", "fingerprint": FINGERPRINT}


def serve(app):
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


@pytest.fixture
def sites(tmp_path):
    """(root client as a worker, relay service, relay client as a worker, the upstream requests' paths)."""
    root_app = create_app(CoordinatorConfig(data_dir=tmp_path / "root", gateway_interval=0))
    root_server, root_url = serve(root_app)
    CoordinatorClient(root_url, token=root_app.extensions["fedmoe_auth"].admin_token).create_expert(
        "e1", make_adapter(), expert_spec())
    join = (tmp_path / "root" / "join_token").read_text().strip()
    relay_app = create_relay_app(RelayConfig(upstream=root_url, join_token=join, relay_id="r1",
                                             coordinator=CoordinatorConfig(data_dir=tmp_path / "relay"),
                                             forward=ForwardPolicy(interval=3600),
                                             upstream_diffs=DiffPulls("fp16", full_every=3)))
    relay = relay_app.extensions["fedmoe"]
    relay.join_upstream()
    relay_server, relay_url = serve(relay_app)
    at_root, at_relay = CoordinatorClient(root_url, token=join), CoordinatorClient(relay_url, token=join)
    at_root.register_worker("w-root", "e1", BASE)
    at_relay.register_worker("w1", "e1", BASE)
    calls: list[str] = []
    original = relay.upstream._request

    def counted(method, path, **kwargs):
        calls.append(f"{method} {path}" + ("?since" if "since" in (kwargs.get("params") or {}) else ""))
        return original(method, path, **kwargs)

    relay.upstream._request = counted
    try:
        yield at_root, relay, at_relay, calls
    finally:
        for client in (at_root, at_relay):
            client.close()
        relay_server.shutdown()
        relay_server.server_close()
        relay.close()
        root_server.shutdown()
        root_server.server_close()
        root_app.extensions["fedmoe"].close()


def new_root_version(at_root: CoordinatorClient, seed: int) -> int:
    version = at_root.expert("e1")["version"]
    at_root.push_update("e1", dumps(random_like(make_adapter(), seed)), {
        "update_id": f"root-{seed}", "base_version": version, "num_samples": 4, "worker_id": "w-root"})
    return at_root.expert("e1")["version"]


def fetch(relay) -> None:
    """Let the relay's cache take the root's current version now, as its revalidation would."""
    relay.cache.revalidate_seconds = 0.0
    relay.cache.get("e1", wait=True)
    relay.cache.revalidate_seconds = 1e9


def test_new_versions_come_as_diffs_with_a_full_fetch_every_third_time(sites):
    at_root, relay, at_relay, calls = sites
    fetch(relay)  # the first fetch of a process is a full one
    kinds = []
    for seed in range(1, 6):
        version = new_root_version(at_root, seed)
        calls.clear()
        fetch(relay)
        weights = [c for c in calls if "/weights" in c]
        kinds.append("diff" if weights == ["GET /experts/e1/weights?since"] else "full")
        pulled = at_relay.pull_weights("e1", worker_id="w1")
        exact = at_root.pull_weights("e1", worker_id="w-root")
        assert pulled.version == exact.version == version
        # the root's weights within fp16's error of the diffs since the last full fetch, under an ETag of their own
        assert all(torch.allclose(pulled.tensors[k], exact.tensors[k], rtol=0, atol=2e-3) for k in exact.tensors)
        if kinds[-1] == "diff":
            assert pulled.etag != exact.etag
            assert any(not torch.equal(pulled.tensors[k], exact.tensors[k]) for k in exact.tensors)
        else:
            assert pulled.etag == exact.etag
            assert all(torch.equal(pulled.tensors[k], exact.tensors[k]) for k in exact.tensors)
        assert at_relay.pull_weights("e1", etag=pulled.etag, worker_id="w1").tensors is None  # 304 on our ETag
    assert kinds == ["diff", "diff", "full", "diff", "diff"]
    assert relay.cache.diff_fetches == 4 and relay.cache.upstream_fetches == 2


def test_nothing_new_costs_no_body_and_a_pruned_base_falls_back_to_a_full_fetch(sites, monkeypatch):
    at_root, relay, _, calls = sites
    fetch(relay)
    calls.clear()
    fetch(relay)  # the root is still at version 0: an empty diff answer, nothing stored
    assert relay.cache.diff_fetches == 0 and relay.cache.known("e1").version == 0
    new_root_version(at_root, 1)
    from protocol.errors import NotFound

    def gone(*args, **kwargs):
        raise NotFound("version 0 is no longer kept")

    monkeypatch.setattr(relay.upstream, "pull_diff", gone)
    fetch(relay)
    assert relay.cache.known("e1").version == 1 and relay.cache.upstream_fetches == 2


def test_bad_settings_are_refused_with_the_flag_named():
    from compression.errors import CompressionError

    with pytest.raises(CompressionError, match="unknown codec"):
        DiffPulls("nope")
    with pytest.raises(ValueError, match="--upstream-full-pull-every must be >= 1"):
        DiffPulls("int8", full_every=0)
