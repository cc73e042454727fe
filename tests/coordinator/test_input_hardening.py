"""Regression tests of issue 13 (coordinator side): each case once gave a 500, stored something bad,
or stopped the data dir from starting again. Flask test client on real files in tmp_path."""
from __future__ import annotations

import json
import math
import os
import stat
import struct
import threading
from pathlib import Path

import pytest
import torch

from coordinator.aggregation import l2_norm
from gateway.router import MAX_PROMPT_CHARS, route as route_prompt, text_profile
from protocol.schemas import EXPERT_HEADER, UPDATE_HEADER
from protocol.streaming import tensors_from_buffer
from protocol.errors import InvalidPayload
from protocol.tensors import dumps, load_file
from tests.helpers import FINGERPRINT, expert_spec, make_adapter, push, put_expert, random_like, update_meta

DEEP = "[" * 3000 + "]" * 3000


def strict_json(data: bytes):
    """Parse as a strict JSON reader would: NaN and Infinity are not JSON."""
    def refuse(constant: str):
        raise AssertionError(f"response holds {constant}")
    return json.loads(data, parse_constant=refuse)


def with_metadata(body: bytes, metadata: object) -> bytes:
    """The same safetensors file with its ``__metadata__`` replaced (the header re-padded to 8 bytes)."""
    (length,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8:8 + length]) | {"__metadata__": metadata}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body[8 + length:]


def full_spec(num_parameters: int) -> dict:
    return {"kind": "full", "full": {"num_parameters": num_parameters},
            "base_model": {"id": "tiny-test", "fingerprint": FINGERPRINT}}


def stored_blobs(data_dir: Path) -> list[Path]:
    return [p for p in (data_dir / "blobs").glob("??/*") if p.is_file()]


# A. a relative --data-dir ----------------------------------------------------------------------------


def test_a_relative_data_dir_serves_weights_from_the_working_directory(make_app, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = make_app(data_dir="fedmoe-data")  # the CLI default, relative
    assert app.extensions["fedmoe"].config.data_dir == tmp_path / "fedmoe-data"
    client = app.test_client()
    adapter = make_adapter()
    assert put_expert(client, "e", adapter).status_code == 201
    r = client.get("/api/v1/experts/e/weights")
    assert r.status_code == 200, r.data[:300]  # was 500: send_file looked under the coordinator package
    assert torch.equal(tensors_from_buffer(bytearray(r.data))[sorted(adapter)[0]], adapter[sorted(adapter)[0]])
    assert stored_blobs(tmp_path / "fedmoe-data")


# B. safetensors headers checked with the loader's rules; quarantine at start --------------------------


def test_full_expert_with_non_string_metadata_is_refused_and_nothing_is_stored(client, tmp_path):
    tensors = {"model.w": torch.ones(4, 3), "model.b": torch.zeros(3)}
    body = with_metadata(dumps(tensors), {"x": 1})  # the tester's payload: passed our check, broke the loader
    r = client.put("/api/v1/experts/f", data=body, headers={EXPERT_HEADER: json.dumps(full_spec(15))})
    assert r.status_code == 400, r.data
    assert "__metadata__" in r.get_json()["error"]["message"] or "string" in r.get_json()["error"]["message"]
    assert client.get("/api/v1/experts").get_json()["experts"] == []
    assert stored_blobs(tmp_path / "data") == []
    good = with_metadata(dumps(tensors), {"x": "1"})  # strings are fine
    assert client.put("/api/v1/experts/f", data=good, headers={EXPERT_HEADER: json.dumps(full_spec(15))}) \
        .status_code == 201


def test_raw_update_with_non_string_metadata_is_refused_before_it_is_recorded(client):
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    meta = update_meta()
    r = push(client, "e", None, meta, body=with_metadata(dumps(random_like(adapter, 1)), {"x": [1]}))
    assert r.status_code == 400, r.data
    assert client.get(f"/api/v1/updates/{meta['update_id']}").status_code == 404  # not recorded
    assert client.get("/api/v1/experts/e").get_json()["version"] == 0


def test_buffer_parser_applies_the_same_metadata_rule():
    body = with_metadata(dumps({"a": torch.zeros(2)}), {"x": 1})
    with pytest.raises(InvalidPayload, match="__metadata__"):
        tensors_from_buffer(bytearray(body))


def test_restart_quarantines_an_expert_whose_blob_the_loader_refuses(make_app, tmp_path):
    app = make_app()
    client = app.test_client()
    adapter = make_adapter()
    put_expert(client, "bad", adapter)
    put_expert(client, "good", make_adapter(seed=1))
    c = app.extensions["fedmoe"]
    path = c.store.blobs.local_path(c.store.weights("bad").digest)
    original = path.read_bytes()
    c.close()
    path.write_bytes(with_metadata(original, {"x": 1}))  # what an older coordinator accepted

    client = make_app().test_client()  # used to die in Coordinator.__init__
    assert [e["name"] for e in client.get("/api/v1/experts").get_json()["experts"]] == ["good"]
    assert client.get("/api/v1/experts/good/weights").status_code == 200
    assert client.get("/api/v1/gateway").status_code == 200  # was 500
    events = client.get("/api/v1/events?kind=expert_quarantined").get_json()["events"]
    assert [e["expert"] for e in events] == ["bad"]
    kept = tmp_path / "data" / "quarantine"
    assert [p.read_bytes() for p in kept.iterdir()] == [with_metadata(original, {"x": 1})]
    assert not path.exists()
    # the specialty can start over
    assert put_expert(client, "bad", adapter).status_code == 201


def test_restart_quarantines_a_pending_update_the_loader_refuses(make_app):
    app = make_app(aggregation="fedbuff", buffer_size=2)
    client = app.test_client()
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    bad_meta, good_meta = update_meta(), update_meta()
    assert push(client, "e", random_like(adapter, 1), bad_meta).status_code == 202  # pending (K=2)
    c = app.extensions["fedmoe"]
    path = c.store._blobs.path(c.store.rows.update(bad_meta["update_id"]).blob)
    damaged = with_metadata(path.read_bytes(), {"x": 1})
    c.close()
    path.write_bytes(damaged)

    client = make_app(aggregation="fedbuff", buffer_size=2).test_client()
    assert client.get(f"/api/v1/updates/{bad_meta['update_id']}").get_json()["status"] == "quarantined"
    assert [e["update_id"] for e in client.get("/api/v1/events?kind=update_quarantined").get_json()["events"]] \
        == [bad_meta["update_id"]]
    # the expert goes on: two new updates make one step
    assert push(client, "e", random_like(adapter, 2), good_meta).status_code == 202
    assert push(client, "e", random_like(adapter, 3), update_meta()).status_code == 202
    info = client.get("/api/v1/experts/e").get_json()
    assert (info["version"], info["updates_applied"], info["pending_updates"]) == (1, 2, 0)


# C. JSON size and depth ------------------------------------------------------------------------------


def test_json_bodies_have_per_route_size_limits(client):
    put_expert(client, "e", make_adapter())
    r = client.post("/api/v1/route", json={"prompt": "x" * (64 << 10)})
    assert r.status_code == 413 and r.get_json()["error"]["code"] == "payload_too_large"
    big = {"worker_id": "w", "specialty": "e", "base_model": {"id": "m", "fingerprint": FINGERPRINT},
           "pad": "x" * (1 << 20)}
    r = client.post("/api/v1/workers", json=big)
    assert r.status_code == 413, r.data[:200]
    r = client.put("/api/v1/experts/e/profiles/w", json={"pad": "y" * (1 << 20)})
    assert r.status_code == 413, r.data[:200]
    # just under the limits is parsed (and refused or served on its merits, not for size)
    assert client.post("/api/v1/route", json={"prompt": "x" * 60000}).status_code == 404  # no profiles yet


@pytest.mark.parametrize("method, path, kind", [
    ("post", "/api/v1/route", "body"),
    ("post", "/api/v1/workers", "body"),
    ("put", "/api/v1/experts/e/profiles/w", "body"),
    ("post", "/api/v1/experts/e/updates", UPDATE_HEADER),
    ("put", "/api/v1/experts/x", EXPERT_HEADER),
    ("get", "/api/v1/experts/e/weights?since=0&codec=fp16&codec_config=", "query"),
])
def test_json_nested_3000_deep_is_a_400_everywhere(client, method, path, kind):
    put_expert(client, "e", make_adapter())
    if kind == "body":
        r = getattr(client, method)(path, data=DEEP, content_type="application/json")
    elif kind == "query":
        r = client.get(path + DEEP)
    else:
        r = getattr(client, method)(path, data=dumps(make_adapter()), headers={kind: DEEP})
    assert r.status_code == 400, (r.status_code, r.data[:300])
    assert "deeper than 32" in r.get_json()["error"]["message"]
    deep_object = '{"a":' * 40 + "1" + "}" * 40
    r = getattr(client, method)(path, data=deep_object, content_type="application/json") if kind == "body" else None
    assert r is None or r.status_code == 400


def test_router_reads_a_bounded_start_of_the_prompt():
    profiles = {"py": text_profile(["def f(x): return x"]), "sql": text_profile(["SELECT a FROM t"])}
    head = ("select name from users where id = 1; " * 400)[:MAX_PROMPT_CHARS]
    long = route_prompt(head + "def python_function(): pass\n" * 10000, profiles)
    assert long == route_prompt(head, profiles)


# D. overflow -----------------------------------------------------------------------------------------


def test_l2_norm_of_huge_finite_values_is_finite():
    norm = l2_norm({"a": torch.full((4,), 3e38), "b": torch.full((2, 2), -3e38)})
    assert math.isfinite(norm) and norm == pytest.approx(3e38 * math.sqrt(8), rel=1e-6)


def test_an_update_whose_result_overflows_is_refused_and_nothing_is_recorded(make_app):
    app = make_app(norm_check="reject", norm_warmup=1, norm_factor=10.0)
    client = app.test_client()
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    huge = {k: torch.full_like(v, 3e38) for k, v in adapter.items()}
    assert push(client, "e", huge, update_meta(base_version=0)).status_code == 202
    meta = update_meta(base_version=1)
    r = push(client, "e", huge, meta)  # 3e38 + 3e38 = Inf in float32
    assert r.status_code == 422, r.data
    assert r.get_json()["error"]["details"]["reason"] == "result_not_finite"
    assert client.get(f"/api/v1/updates/{meta['update_id']}").status_code == 404
    c = app.extensions["fedmoe"]
    assert c.store.rows.expert("e").version == 1
    assert all(bool(torch.isfinite(t).all()) for t in load_file(c.store.blobs.local_path(c.store.weights("e").digest)).values())
    norms = c.store.rows.recent_norms("e", 20)
    assert norms and all(math.isfinite(n) for n in norms)
    # every JSON answer stays strict JSON, and the gateway and a diff pull are served
    for path in ("/api/v1/experts/e", "/api/v1/events", "/api/v1/experts"):
        r = client.get(path)
        assert r.status_code == 200 and strict_json(r.data)
    # the LoRA gateway scales B by alpha / rank = 2: 3e38 would be Inf there, so it is refused, not stored
    for path in ("/api/v1/gateway", "/api/v1/gateway/weights"):
        r = client.get(path)
        assert r.status_code == 409 and r.get_json()["error"]["details"]["reason"] == "gateway_not_finite"
    assert client.get("/api/v1/experts/e/weights?since=0&codec=bf16").status_code == 200
    r = client.get("/api/v1/experts/e/weights?since=0&codec=fp16")  # 3e38 is beyond fp16: said, not a 500
    assert r.status_code == 404 and "full weights" in r.get_json()["error"]["message"]  # workers fall back on 404
    # a normal-sized update still passes the norm check: its median is finite
    assert push(client, "e", random_like(adapter, 5), update_meta(base_version=1)).status_code == 202


def test_a_huge_train_loss_does_not_turn_into_infinity(client):
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    assert push(client, "e", random_like(adapter, 1), update_meta(num_samples=1000, train_loss=1e308)) \
        .status_code == 202
    info = strict_json(client.get("/api/v1/experts/e").data)
    assert info["last_train_loss"] == pytest.approx(1e308)


# E. names, races -------------------------------------------------------------------------------------


def test_names_ending_in_a_newline_are_refused(client):
    adapter = make_adapter()
    assert put_expert(client, "e%0A", adapter).status_code == 400  # the path ends in a newline
    assert put_expert(client, "e", adapter).status_code == 201
    r = client.post("/api/v1/workers", json={"worker_id": "w\n", "specialty": "e",
                                             "base_model": {"id": "m", "fingerprint": FINGERPRINT}})
    assert r.status_code == 400
    r = push(client, "e", random_like(adapter, 1), update_meta() | {"update_id": "u1\n"})
    assert r.status_code == 400
    assert [e["name"] for e in client.get("/api/v1/experts").get_json()["experts"]] == ["e"]


def test_diff_pulls_racing_with_pruning_never_fail_with_a_500(make_app):
    app = make_app(keep_versions=2)
    adapter = make_adapter(layers=8, d_in=64, d_out=64)
    put_expert(app.test_client(), "e", adapter)
    c = app.extensions["fedmoe"]
    statuses: list[int] = []
    done = threading.Event()

    def pull() -> None:
        client = app.test_client()
        while not done.is_set():
            since = max(0, c.store.rows.expert("e").version - 1)
            r = client.get(f"/api/v1/experts/e/weights?since={since}&codec=bf16")
            statuses.append(r.status_code)
            assert r.status_code in (200, 304) or r.is_json

    pullers = [threading.Thread(target=pull) for _ in range(3)]
    for t in pullers:
        t.start()
    try:
        client = app.test_client()
        for i in range(40):
            assert push(client, "e", random_like(adapter, i), update_meta(base_version=0)).status_code == 202
    finally:
        done.set()
        for t in pullers:
            t.join()
    assert statuses and set(statuses) <= {200, 304, 404, 409}, sorted(set(statuses))


# F. files and messages -------------------------------------------------------------------------------


def test_data_dir_and_its_databases_and_tokens_are_private(make_app, tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o755)
    os.chmod(data_dir, 0o755)
    client = make_app(data_dir=data_dir).test_client()
    put_expert(client, "e", make_adapter())
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    private = [p for p in data_dir.iterdir() if p.is_file()]
    names = {p.name for p in private}
    assert {"manifest.sqlite", "auth.sqlite", "admin_token", "join_token"} <= names, names
    assert "manifest.sqlite-wal" in names
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in private} == {p.name: "0o600" for p in private}


def test_error_bodies_show_no_server_paths(client, tmp_path):
    r = client.put("/api/v1/experts/e", data=b"\x08" + b"\0" * 7 + b"not json",
                   headers={EXPERT_HEADER: json.dumps(expert_spec())})
    assert r.status_code == 400
    assert str(tmp_path) not in r.get_data(as_text=True) and "/tmp" not in r.get_data(as_text=True), r.data


def test_a_pending_update_whose_result_would_overflow_is_quarantined_not_applied(make_app):
    """A data dir where such an update was recorded (fedbuff waits for K before a result exists)."""
    app = make_app(aggregation="fedbuff", buffer_size=2)
    client = app.test_client()
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    huge = {k: torch.full_like(v, 3e38) for k, v in adapter.items()}
    for _ in range(2):  # one step of the mean of two 3e38 updates: finite
        assert push(client, "e", huge, update_meta(base_version=0)).status_code == 202
    late = update_meta(base_version=1)
    assert push(client, "e", huge, late).status_code == 202  # pending: its step needs a second update
    app.extensions["fedmoe"].close()

    client = make_app(aggregation="fedasync").test_client()  # restarted applying each update at once
    assert client.get(f"/api/v1/updates/{late['update_id']}").get_json()["status"] == "quarantined"
    info = client.get("/api/v1/experts/e").get_json()
    assert (info["version"], info["pending_updates"]) == (1, 0)
    c = client.application.extensions["fedmoe"]
    assert all(bool(torch.isfinite(t).all()) for t in load_file(c.store.blobs.local_path(c.store.weights("e").digest)).values())
