"""Pulls over an emulated WAN (bench/wanemu) and resumed after a cut, against the real coordinator."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import requests
import torch

from bench.wanemu import DelayProxy, NamespaceUnavailable, WanLink, check_available, list_namespaces
from bench.wanemu.namespaces import PREFIX
from bench.wanemu.probe import ProbeServer, measure
from protocol.client import CoordinatorClient
from protocol.credentials import local_token
from protocol.errors import Unavailable
from protocol.resume import check_etag, resumable_body
from protocol.streaming import tensors_from_buffer
from protocol.tensors import load_file
from tests.e2e.conftest import ROOT, admin_headers, env, module_coordinator
from protocol.tensors import dumps
from tests.helpers import expert_spec, make_adapter, update_meta

# 4 layers x 2 modules x (16x1024 + 1024x16) float32 = 1 MiB: several round trips at 20 Mbit/s
ADAPTER = dict(rank=16, d_in=1024, d_out=1024, layers=4)
WAN_MBIT, WAN_RTT_MS = 20.0, 50.0


@pytest.fixture
def namespaces():
    """Skip where namespaces cannot be made; fail if the test leaves one behind."""
    try:
        check_available()
    except NamespaceUnavailable as exc:
        pytest.skip(f"WAN emulation needs network namespaces: {exc}")
    def ours() -> set[str]:  # other processes may run namespaces of their own meanwhile
        return {n for n in list_namespaces() if n.startswith(f"{PREFIX}{os.getpid()}")}

    assert not ours()
    yield
    assert not ours(), f"a test left network namespaces behind: {sorted(ours())}"


@pytest.fixture(scope="module")
def expert_server(tmp_path_factory):
    """One coordinator holding expert "e" for the module's tests (they read it; the two that add or change an expert
    use experts of their own, "f" and "g")."""
    for url in module_coordinator(tmp_path_factory):
        adapter = make_adapter(**ADAPTER)
        CoordinatorClient(url).experts.create("e", adapter, expert_spec(rank=16))
        yield url, adapter


def test_link_has_the_configured_delay_and_bandwidth(namespaces) -> None:
    server = ProbeServer()
    try:
        with WanLink(server.address, WAN_MBIT, WAN_RTT_MS) as link:
            host, port = link.proxy.address
            out = subprocess.run(link.site.command([sys.executable, "-m", "bench.wanemu.probe", host, str(port),
                                                    str(1 << 20)]),
                                 capture_output=True, text=True, timeout=120, check=True, cwd=ROOT, env=env())
            m = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        server.close()
    assert m["rtt_ms_min"] >= WAN_RTT_MS - 1  # each direction waited its 25 ms in the proxy
    assert m["download_mbit_s"] <= WAN_MBIT * 1.15 and m["upload_mbit_s"] <= WAN_MBIT * 1.15  # tbf shaped both ways


PULL = """
import hashlib, json, sys
from protocol.client import CoordinatorClient
from protocol.tensors import save_file
pulled = CoordinatorClient(sys.argv[1], token=sys.argv[2]).experts.pull("e")
save_file(pulled.tensors, sys.argv[3])
print(json.dumps({"version": pulled.version, "etag": pulled.etag, "nbytes": pulled.nbytes}))
"""


def test_worker_pulls_through_the_emulated_wan(namespaces, expert_server, tmp_path) -> None:
    url, adapter = expert_server
    port = int(url.rsplit(":", 1)[1])
    with WanLink(("127.0.0.1", port), WAN_MBIT, WAN_RTT_MS) as link:
        out = subprocess.run(link.site.command([sys.executable, "-c", PULL, link.url, local_token(url),
                                                str(tmp_path / "pulled.safetensors")]),
                             capture_output=True, text=True, timeout=120, cwd=ROOT, env=env())
        assert out.returncode == 0, out.stderr
        pulled = json.loads(out.stdout.strip().splitlines()[-1])
        through_link = link.proxy.bytes_to_client
    direct = requests.get(f"{url}/api/v1/experts/e/weights", headers=admin_headers(url), timeout=30)
    assert pulled["etag"] == direct.headers["ETag"] and pulled["nbytes"] == len(direct.content)
    assert through_link >= pulled["nbytes"]  # the body really crossed the emulated link
    got = load_file(tmp_path / "pulled.safetensors")
    assert got.keys() == adapter.keys() and all(torch.equal(got[k], adapter[k]) for k in adapter)


def test_interrupted_pull_resumes_where_it_stopped(expert_server) -> None:
    url, adapter = expert_server
    size = len(requests.get(f"{url}/api/v1/experts/e/weights", headers=admin_headers(url), timeout=30).content)
    port = int(url.rsplit(":", 1)[1])
    with DelayProxy(("127.0.0.1", port), one_way_s=0.0, cut_after=size * 6 // 10) as proxy:  # every connection dies at 60%
        pulled = CoordinatorClient(proxy.url(), token=local_token(url)).experts.pull("e")
        sent = proxy.bytes_to_client
    assert pulled.resumes == 1 and pulled.nbytes == size
    assert sent < size + 4096  # headers twice, but no body byte sent twice
    assert all(torch.equal(pulled.tensors[k], adapter[k]) for k in adapter)


def test_weights_honour_range_and_if_range(expert_server) -> None:
    url, _ = expert_server
    weights, headers = f"{url}/api/v1/experts/e/weights", admin_headers(url)
    full = requests.get(weights, headers=headers, timeout=30)
    etag, size = full.headers["ETag"], len(full.content)
    part = requests.get(weights, headers=headers | {"Range": "bytes=100-", "If-Range": etag}, timeout=30)
    assert part.status_code == 206 and part.content == full.content[100:]
    assert part.headers["Content-Range"] == f"bytes 100-{size - 1}/{size}"
    stale = requests.get(weights, headers=headers | {"Range": "bytes=100-", "If-Range": '"' + "0" * 64 + '"'}, timeout=30)
    assert stale.status_code == 200 and stale.content == full.content
    beyond = requests.get(weights, headers=headers | {"Range": f"bytes={size + 10}-", "If-Range": etag}, timeout=30)
    assert beyond.status_code == 416 and beyond.json()["error"]["message"]


def test_resume_starts_over_when_the_weights_changed(expert_server) -> None:
    """A stale If-Range gets the whole new body (200), and the pull restarts on it from byte 0."""
    url, _ = expert_server
    other = make_adapter(**ADAPTER, seed=7)
    CoordinatorClient(url).experts.create("f", other, expert_spec(rank=16))
    headers, port = admin_headers(url), int(url.rsplit(":", 1)[1])
    size = len(requests.get(f"{url}/api/v1/experts/e/weights", headers=headers, timeout=30).content)
    with DelayProxy(("127.0.0.1", port), one_way_s=0.0, cut_after=size // 2) as proxy:
        first = requests.get(f"{proxy.url()}/api/v1/experts/e/weights", headers=headers, stream=True, timeout=30)

        def refetch(extra: dict[str, str]) -> requests.Response:
            """The resume lands on different weights ("f" stands for e's next version): its ETag no longer matches."""
            return requests.get(f"{url}/api/v1/experts/f/weights", headers=headers | extra, stream=True, timeout=30)

        body, response, resumes = resumable_body(first, refetch, max_resumes=3, where=url)
    assert resumes == 1 and response.status_code == 200
    got = tensors_from_buffer(body)
    assert all(torch.equal(got[k], other[k]) for k in other)


def test_a_reassembled_body_must_match_its_etag() -> None:
    body = bytearray(b"weights")
    check_etag(body, '"' + hashlib.sha256(body).hexdigest() + '"', "here")
    with pytest.raises(Unavailable, match="does not match its ETag"):
        check_etag(bytearray(b"weightz"), '"' + hashlib.sha256(body).hexdigest() + '"', "here")


def test_delay_proxy_delays_each_direction_without_namespaces() -> None:
    """The proxy alone (no root needed): a request and its answer each wait the one-way delay."""
    server = ProbeServer()
    try:
        with DelayProxy(server.address, one_way_s=0.03) as proxy:
            m = measure(*proxy.address, pings=5, transfer_bytes=1 << 20)
            through = proxy.bytes_to_client, proxy.bytes_to_target
    finally:
        server.close()
    assert m["rtt_ms_min"] >= 59  # 2 x 30 ms: a proxy that delayed one direction only would show ~30
    assert through[0] >= 1 << 20 and through[1] >= 1 << 20  # the bulk transfers went through it, both ways


def test_interrupted_gateway_pull_resumes(expert_server) -> None:
    url, adapter = expert_server
    admin = CoordinatorClient(url)
    admin.experts.create("g", adapter, expert_spec(rank=16))  # its own: "e" stays as the other tests read it
    admin.updates.push("g", dumps({k: torch.full_like(v, 0.01) for k, v in adapter.items()}), update_meta(num_samples=5))
    want = admin.gateway.tensors()
    size = len(requests.get(f"{url}/api/v1/gateway/weights?format=safetensors", headers=admin_headers(url),
                            timeout=30).content)
    with DelayProxy(("127.0.0.1", int(url.rsplit(":", 1)[1])), one_way_s=0.0, cut_after=size * 7 // 10) as proxy:
        got = CoordinatorClient(proxy.url(), token=local_token(url)).gateway.tensors()
        sent, connections = proxy.bytes_to_client, proxy.connections
    assert connections == 2 and size < sent < size + 4096  # cut once, resumed, no body byte twice
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
