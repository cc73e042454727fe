"""Every endpoint through the Flask test client, bad inputs included."""
import io
import json
import pickle

import numpy as np
import pytest
import torch

from protocol.schemas import EXPERT_HEADER, UPDATE_HEADER
from protocol.tensors import dumps, loads
from tests.helpers import FINGERPRINT, expert_spec, make_adapter, push, put_expert, random_like, update_meta


def error_code(response) -> str:
    body = response.get_json()
    assert "error" in body and body["error"]["message"], body
    return body["error"]["code"]


def test_health(client):
    assert client.get("/api/v1/health").get_json() == {"status": "ok", "experts": 0, "store": "ok"}


def test_create_expert_then_list_and_fetch_weights(client):
    adapter = make_adapter()
    r = put_expert(client, "python_expert", adapter)
    assert r.status_code == 201
    assert r.get_json()["version"] == 0 and r.get_json()["lora"]["rank"] == 2

    experts = client.get("/api/v1/experts").get_json()["experts"]
    assert [e["name"] for e in experts] == ["python_expert"]

    w = client.get("/api/v1/experts/python_expert/weights")
    assert w.status_code == 200 and w.headers["X-FedMoE-Version"] == "0"
    got = loads(w.data)
    assert all(torch.equal(got[k], adapter[k]) for k in adapter)


def test_same_spec_again_is_ok_and_keeps_the_first_adapter(client):
    first = make_adapter(seed=0)
    put_expert(client, "e", first)
    r = put_expert(client, "e", make_adapter(seed=1))
    assert r.status_code == 200
    got = loads(client.get("/api/v1/experts/e/weights").data)
    assert all(torch.equal(got[k], first[k]) for k in first)


@pytest.mark.parametrize("spec, words", [
    (expert_spec(rank=2, alpha=8.0), "alpha"),
    (expert_spec(fingerprint="cd" * 32), "base model"),
    (expert_spec(modules=("q_proj", "k_proj", "v_proj")), "target_modules"),
])
def test_different_setup_is_a_409_that_says_what_differs(client, spec, words):
    put_expert(client, "e", make_adapter())
    r = put_expert(client, "e", make_adapter(), spec)
    assert r.status_code == 409 and error_code(r) == "conflict"
    assert words in r.get_json()["error"]["message"]


def test_etag_and_if_none_match(client):
    put_expert(client, "e", make_adapter())
    first = client.get("/api/v1/experts/e/weights")
    etag = first.headers["ETag"]
    assert client.get("/api/v1/experts/e/weights", headers={"If-None-Match": etag}).status_code == 304
    push(client, "e", random_like(make_adapter(), 1))
    after = client.get("/api/v1/experts/e/weights", headers={"If-None-Match": etag})
    assert after.status_code == 200 and after.headers["X-FedMoE-Version"] == "1"


def test_push_applies_with_fedasync_and_retry_is_applied_once(client):
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    delta = random_like(adapter, 1)
    meta = update_meta(base_version=0, num_samples=7)
    r = push(client, "e", delta, meta)
    assert r.status_code == 202
    assert r.get_json() | {} == {"update_id": meta["update_id"], "expert": "e", "status": "applied",
                                 "applied_version": 1, "expert_version": 1}
    again = push(client, "e", delta, meta)
    assert again.status_code == 200 and again.get_json()["applied_version"] == 1

    info = client.get("/api/v1/experts/e").get_json()
    assert info["version"] == 1 and info["updates_applied"] == 1 and info["samples_seen"] == 7
    got = loads(client.get("/api/v1/experts/e/weights").data)
    assert all(torch.allclose(got[k], adapter[k] + delta[k]) for k in adapter)
    assert client.get(f"/api/v1/updates/{meta['update_id']}").get_json()["status"] == "applied"


def test_stale_update_is_weighted_down(make_app):
    client = make_app(staleness_decay=0.5).test_client()
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    d1, d2 = random_like(adapter, 1), random_like(adapter, 2)
    push(client, "e", d1, update_meta(base_version=0))
    push(client, "e", d2, update_meta(base_version=0))  # staleness 1 -> weight 1 / 1.5
    got = loads(client.get("/api/v1/experts/e/weights").data)
    assert all(torch.allclose(got[k], adapter[k] + d1[k] + d2[k] / 1.5, atol=1e-6) for k in adapter)


def test_fedbuff_waits_for_k_updates_then_applies_weighted_mean(make_app):
    client = make_app(aggregation="fedbuff", buffer_size=2, staleness_decay=0.0).test_client()
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    d1, d2 = random_like(adapter, 1), random_like(adapter, 2)
    assert push(client, "e", d1, update_meta(num_samples=1)).get_json()["status"] == "pending"
    assert client.get("/api/v1/experts/e").get_json()["pending_updates"] == 1
    assert push(client, "e", d2, update_meta(num_samples=3)).get_json()["status"] == "applied"
    got = loads(client.get("/api/v1/experts/e/weights").data)
    assert all(torch.allclose(got[k], adapter[k] + 0.25 * d1[k] + 0.75 * d2[k], atol=1e-6) for k in adapter)


def test_old_versions_stay_fetchable_until_pruned(make_app):
    client = make_app(keep_versions=2).test_client()
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    for i in range(3):
        push(client, "e", random_like(adapter, i), update_meta(base_version=i))
    assert client.get("/api/v1/experts/e/weights?version=3").status_code == 200
    assert client.get("/api/v1/experts/e/weights?version=2").status_code == 200
    pruned = client.get("/api/v1/experts/e/weights?version=1")
    assert pruned.status_code == 404 and "pruned" in pruned.get_json()["error"]["message"]
    versions = client.get("/api/v1/experts/e").get_json()["versions"]
    assert [v["stored"] for v in versions] == [False, False, True, True]


def test_workers_register_and_heartbeat(client):
    base = {"id": "tiny-test", "fingerprint": FINGERPRINT}
    r = client.post("/api/v1/workers", json={"worker_id": "w1", "specialty": "e", "base_model": base})
    assert r.status_code == 200 and r.get_json()["expert"] is None
    assert client.post("/api/v1/workers/w1/heartbeat").status_code == 200
    assert client.post("/api/v1/workers/nobody/heartbeat").status_code == 404
    workers = client.get("/api/v1/workers").get_json()["workers"]
    assert [w["worker_id"] for w in workers] == ["w1"]


def test_workers_are_alive_stale_or_gone():
    from coordinator.liveness import liveness

    assert [liveness(t, 10) for t in (5, 29, 31, 299, 301)] == ["alive", "alive", "stale", "stale", "gone"]
    assert [liveness(t, 60) for t in (179, 181, 1199, 1201)] == ["alive", "stale", "stale", "gone"]
    assert liveness(20, None) == "alive"


def test_worker_list_shows_liveness_and_bad_interval_is_400(client):
    base = {"id": "tiny-test", "fingerprint": FINGERPRINT}
    body = {"worker_id": "w1", "specialty": "e", "base_model": base, "sync_interval": 5}
    assert client.post("/api/v1/workers", json=body).status_code == 200
    (w,) = client.get("/api/v1/workers").get_json()["workers"]
    assert w["status"] == "alive" and w["sync_interval"] == 5
    assert client.post("/api/v1/workers", json=body | {"sync_interval": -1}).status_code == 400


def test_worker_with_other_base_model_is_refused(client):
    put_expert(client, "e", make_adapter())
    base = {"id": "other", "fingerprint": "cd" * 32}
    r = client.post("/api/v1/workers", json={"worker_id": "w1", "specialty": "e", "base_model": base})
    assert r.status_code == 409 and "--base-model" in r.get_json()["error"]["message"]


# --- bad input: every one a 4xx with a JSON error, nothing stored ------------------------------

def _pickled_state() -> bytes:
    buf = io.BytesIO()
    torch.save({k: v for k, v in make_adapter().items()}, buf)  # what a naive client might send
    return buf.getvalue()


BAD_BODIES = {
    "torch pickle": _pickled_state(),
    "plain pickle": pickle.dumps({"x": 1}),
    "empty": b"",
    "random bytes": bytes(range(256)) * 4,
    "truncated safetensors": dumps(make_adapter())[:-10],
}


@pytest.mark.parametrize("kind", sorted(BAD_BODIES))
def test_bad_update_bodies_are_400_and_change_nothing(client, kind):
    put_expert(client, "e", make_adapter())
    r = push(client, "e", None, body=BAD_BODIES[kind])
    assert r.status_code == 400 and error_code(r) == "invalid_payload"
    assert client.get("/api/v1/experts/e").get_json()["version"] == 0


def _with(tensors, **changes):
    out = dict(tensors)
    out.update(changes)
    return out


KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
BAD_TENSORS = {
    "missing tensor": lambda d: {k: v for k, v in d.items() if k != KEY},
    "extra tensor": lambda d: _with(d, extra=torch.zeros(2)),
    "wrong shape": lambda d: _with(d, **{KEY: torch.zeros(3, 6)}),
    "wrong dtype": lambda d: _with(d, **{KEY: d[KEY].double()}),
    "nan": lambda d: _with(d, **{KEY: torch.full_like(d[KEY], float("nan"))}),
    "inf": lambda d: _with(d, **{KEY: torch.full_like(d[KEY], float("inf"))}),
}


@pytest.mark.parametrize("kind", sorted(BAD_TENSORS))
def test_updates_that_do_not_fit_the_expert_are_422(client, kind):
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    r = push(client, "e", BAD_TENSORS[kind](random_like(adapter, 1)))
    assert r.status_code == 422 and error_code(r) == "invalid_update"
    assert client.get("/api/v1/experts/e").get_json()["version"] == 0


@pytest.mark.parametrize("half", [b"\x00\x7e", b"\x00\x7c"], ids=["nan", "inf"])
def test_compressed_updates_are_checked_tensor_by_tensor_and_refused_whole(client, half):
    from compression import encode_update
    from compression.registry import make_codec
    from compression.wire import index_update_file
    from protocol.tensors import manifest_of

    adapter = make_adapter()
    put_expert(client, "e", adapter)
    manifest = manifest_of(adapter)
    body = bytearray(encode_update(random_like(adapter, 1), manifest, make_codec("fp16", {})))
    spans = index_update_file(io.BytesIO(body), len(body), manifest)
    offset, length = spans[[name for name, _ in manifest].index(KEY)]
    body[offset + length - 2:offset + length] = half  # the encoder refuses NaN: put one in its last value
    r = push(client, "e", None, update_meta(codec="fp16"), body=bytes(body))
    # the codec itself refuses a non-finite decoded value: a payload error naming the tensor
    assert r.status_code == 400 and error_code(r) == "invalid_payload" and KEY in r.get_json()["error"]["message"]
    assert client.get("/api/v1/experts/e").get_json()["version"] == 0
    good = encode_update(random_like(adapter, 2), manifest_of(adapter), make_codec("fp16", {}))
    assert push(client, "e", None, update_meta(codec="fp16"), body=good).status_code == 202


@pytest.mark.parametrize("meta, field", [
    ({"base_version": 0, "num_samples": 1}, "update_id"),
    ({"update_id": "u1", "num_samples": 1}, "base_version"),
    ({"update_id": "u1", "base_version": 0}, "num_samples"),
    ({"update_id": "u1", "base_version": "0", "num_samples": 1}, "base_version"),
    ({"update_id": "u1", "base_version": -1, "num_samples": 1}, "base_version"),
    ({"update_id": "u1", "base_version": 0, "num_samples": 1, "train_loss": "x"}, "train_loss"),
    ({"update_id": "bad id/..", "base_version": 0, "num_samples": 1}, "update_id"),
    ({"update_id": "u1", "base_version": 0, "num_samples": 1, "codec": "zip"}, "codec"),
])
def test_bad_update_metadata_is_400_naming_the_field(client, meta, field):
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    r = push(client, "e", random_like(adapter, 1), meta)
    assert r.status_code == 400 and field in r.get_json()["error"]["message"]


def test_missing_or_garbled_metadata_header_is_400(client):
    put_expert(client, "e", make_adapter())
    body = dumps(random_like(make_adapter(), 1))
    assert client.post("/api/v1/experts/e/updates", data=body).status_code == 400
    r = client.post("/api/v1/experts/e/updates", data=body, headers={UPDATE_HEADER: "{not json"})
    assert r.status_code == 400 and "JSON" in r.get_json()["error"]["message"]


def test_base_version_from_the_future_is_409(client):
    adapter = make_adapter()
    put_expert(client, "e", adapter)
    r = push(client, "e", random_like(adapter, 1), update_meta(base_version=5))
    assert r.status_code == 409 and "ahead" in r.get_json()["error"]["message"]


def test_update_id_reused_for_another_expert_is_409(client):
    adapter = make_adapter()
    put_expert(client, "a", adapter)
    put_expert(client, "b", adapter)
    meta = update_meta()
    assert push(client, "a", random_like(adapter, 1), meta).status_code == 202
    assert push(client, "b", random_like(adapter, 1), meta).status_code == 409


def test_unknown_expert_is_404(client):
    r = push(client, "nobody", random_like(make_adapter(), 1))
    assert r.status_code == 404 and error_code(r) == "not_found"
    assert client.get("/api/v1/experts/nobody/weights").status_code == 404


def test_body_over_the_limit_is_413(make_app):
    client = make_app(max_body_mb=0.001).test_client()  # ~1 KiB
    put_expert(client, "e", make_adapter(rank=1, layers=1, d_in=2, d_out=2), expert_spec(rank=1))
    r = client.post("/api/v1/experts/e/updates", data=b"x" * 5000,
                    headers={UPDATE_HEADER: json.dumps(update_meta())})
    assert r.status_code == 413 and error_code(r) == "payload_too_large"


@pytest.mark.parametrize("tensors, spec", [
    ({"w": torch.zeros(2, 2)}, expert_spec()),                                   # not LoRA names
    ({k: v for k, v in make_adapter().items() if "lora_B" not in k}, expert_spec()),  # unpaired
    (make_adapter(rank=3), expert_spec(rank=2)),                                 # rank mismatch
    (make_adapter(modules=("k_proj",)), expert_spec()),                          # not a target module
])
def test_bad_initial_adapters_are_422(client, tensors, spec):
    r = put_expert(client, "e", tensors, spec)
    assert r.status_code == 422
    assert client.get("/api/v1/experts").get_json()["experts"] == []


@pytest.mark.parametrize("header", [None, "[]", json.dumps({"lora": {"rank": 0, "alpha": 1, "target_modules": ["q"]},
                                                              "base_model": {"id": "x", "fingerprint": FINGERPRINT}})])
def test_bad_expert_metadata_is_400(client, header):
    headers = {} if header is None else {EXPERT_HEADER: header}
    r = client.put("/api/v1/experts/e", data=dumps(make_adapter()), headers=headers)
    assert r.status_code == 400


@pytest.mark.parametrize("name", ["bad name", "-x", "a" * 65])
def test_bad_expert_names_are_400(client, name):
    assert put_expert(client, name, make_adapter()).status_code in (400, 404)


def test_unknown_routes_and_methods_answer_json(client):
    r = client.get("/api/v1/nothing")
    assert r.status_code == 404 and error_code(r) == "not_found"
    r = client.delete("/api/v1/experts")
    assert r.status_code == 405 and r.get_json()["error"]["code"] == "method_not_allowed"
    assert client.get("/api/v1/experts/e/weights?version=abc").status_code in (400, 404)


# --- gateway --------------------------------------------------------------------------------------

def full_updates(tensors, scale):
    mods = {k[: -len(".lora_A.weight")] for k in tensors if k.endswith(".lora_A.weight")}
    return {m: tensors[f"{m}.lora_B.weight"] @ tensors[f"{m}.lora_A.weight"] * scale for m in mods}


def test_gateway_is_the_exact_sample_weighted_average(client):
    a, b = make_adapter(rank=2, seed=1), make_adapter(rank=2, seed=2)
    put_expert(client, "a", a)
    put_expert(client, "b", b)
    da = random_like(a, 3)
    push(client, "a", da, update_meta(num_samples=30))
    push(client, "b", random_like(b, 4, scale=0.0), update_meta(num_samples=10))
    info = client.get("/api/v1/gateway").get_json()
    assert info["weights"] == {"a": 0.75, "b": 0.25}
    assert info["sources"] == {"a": 1, "b": 1} and info["strategy"] == "weighted_average"

    g = loads(client.get("/api/v1/gateway/weights?format=safetensors").data)
    g_rank, g_alpha = info["lora"]["rank"], info["lora"]["alpha"]
    assert g_rank == 4
    a1 = {k: a[k] + da[k] for k in a}
    want_a, want_b = full_updates(a1, 2.0), full_updates(b, 2.0)  # alpha 4 / rank 2
    got = full_updates(g, g_alpha / g_rank)
    for m in want_a:
        expected = 0.75 * want_a[m] + 0.25 * want_b[m]
        assert torch.allclose(got[m], expected, atol=1e-5, rtol=1e-5)


def test_gateway_npz_has_documented_layout_and_no_pickle(client):
    put_expert(client, "a", make_adapter(seed=1))
    r = client.get("/api/v1/gateway/weights?format=npz")
    assert r.status_code == 200
    npz = np.load(io.BytesIO(r.data), allow_pickle=False)
    meta = json.loads(str(npz["__fedmoe__"]))
    assert meta["strategy"] == "weighted_average" and meta["weights"] == {"a": 1.0}
    tensor_keys = [k for k in npz.files if k != "__fedmoe__"]
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in tensor_keys)
    assert npz[tensor_keys[0]].dtype == np.float32


def test_gateway_is_rebuilt_only_when_an_expert_changes(client):
    adapter = make_adapter()
    put_expert(client, "a", adapter)
    v1 = client.get("/api/v1/gateway").get_json()["version"]
    assert client.get("/api/v1/gateway").get_json()["version"] == v1
    push(client, "a", random_like(adapter, 1))
    assert client.get("/api/v1/gateway").get_json()["version"] == v1 + 1


def test_gateway_errors(client):
    assert client.get("/api/v1/gateway").status_code == 404
    put_expert(client, "a", make_adapter())
    r = client.get("/api/v1/gateway/weights?format=pt")
    assert r.status_code == 400 and "format" in r.get_json()["error"]["message"]


def test_configured_gateway_weights(make_app):
    client = make_app(gateway_weights={"a": 3, "b": 1}).test_client()
    put_expert(client, "a", make_adapter(seed=1))
    put_expert(client, "b", make_adapter(seed=2))
    assert client.get("/api/v1/gateway").get_json()["weights"] == {"a": 0.75, "b": 0.25}


# --- compressed updates -----------------------------------------------------------------------------

def test_compressed_update_is_decoded_against_the_manifest(client):
    from compression import decode_update, encode_update, make_codec
    from protocol.tensors import manifest_of

    adapter = make_adapter()
    put_expert(client, "e", adapter)
    delta = random_like(adapter, 1)
    manifest = manifest_of(delta)
    config = {"ratio": 0.25, "block_size": 8}
    codec = make_codec("topk+int8", config)
    body = encode_update(delta, manifest, codec, seed=3)
    meta = update_meta(codec="topk+int8", codec_config=config)
    assert push(client, "e", None, meta, body=body).status_code == 202
    sent = decode_update(body, manifest, codec)
    got = loads(client.get("/api/v1/experts/e/weights").data)
    assert all(torch.allclose(got[k], adapter[k] + sent[k]) for k in adapter)
    assert any(not torch.allclose(sent[k], delta[k]) for k in delta)  # it really was lossy


@pytest.mark.parametrize("cut", [lambda b: b[:-3], lambda b: b + b"\0", lambda b: b"FMC1" + b[4:20]])
def test_truncated_or_padded_compressed_payload_is_400(client, cut):
    from compression import encode_update, make_codec
    from protocol.tensors import manifest_of

    adapter = make_adapter()
    put_expert(client, "e", adapter)
    delta = random_like(adapter, 1)
    body = encode_update(delta, manifest_of(delta), make_codec("int8"))
    r = push(client, "e", None, update_meta(codec="int8"), body=cut(body))
    assert r.status_code == 400 and error_code(r) == "invalid_payload"
    assert client.get("/api/v1/experts/e").get_json()["version"] == 0


def test_unknown_codec_lists_the_valid_ones(client):
    put_expert(client, "e", make_adapter())
    r = push(client, "e", None, update_meta(codec="zstd"), body=b"\0" * 10)
    message = r.get_json()["error"]["message"]
    assert r.status_code == 400 and "topk" in message and "int8" in message and "safetensors" in message


# --- compressed pulls and per-worker byte tallies -------------------------------------------------

def test_diff_pull_gives_the_compressed_difference_since_a_version(client):
    from compression import decode_update, make_codec
    from protocol.tensors import manifest_of

    adapter = make_adapter()
    put_expert(client, "e", adapter)
    for i in range(2):
        push(client, "e", random_like(adapter, i), update_meta(base_version=i))
    v0 = loads(client.get("/api/v1/experts/e/weights?version=0").data)
    v2 = loads(client.get("/api/v1/experts/e/weights").data)
    r = client.get("/api/v1/experts/e/weights?since=0&codec=fp16")
    assert r.status_code == 200 and r.headers["X-FedMoE-Version"] == "2"
    diff = decode_update(r.data, manifest_of(adapter), make_codec("fp16"))
    assert all(torch.allclose(v0[k] + diff[k], v2[k], atol=1e-3) for k in adapter)
    assert len(r.data) < len(dumps(v2)) * 0.6  # half the bytes of a full fp32 pull, plus framing

    assert client.get("/api/v1/experts/e/weights?since=2&codec=fp16").status_code == 304
    assert client.get("/api/v1/experts/e/weights?since=9&codec=fp16").status_code == 404
    assert client.get("/api/v1/experts/e/weights?since=0&codec=nope").status_code == 400
    assert client.get("/api/v1/experts/e/weights?since=0&codec_config=[1]").status_code == 400


def test_bytes_up_and_down_are_tallied_per_worker(client):
    adapter = make_adapter()
    base = {"id": "tiny-test", "fingerprint": FINGERPRINT}
    client.post("/api/v1/workers", json={"worker_id": "w1", "specialty": "e", "base_model": base})
    put_expert(client, "e", adapter)
    body = dumps(random_like(adapter, 1))
    push(client, "e", None, update_meta(worker_id="w1"), body=body)
    pulled = client.get("/api/v1/experts/e/weights", headers={"X-FedMoE-Worker": "w1"})
    (w,) = client.get("/api/v1/workers").get_json()["workers"]
    numel = sum(t.numel() for t in adapter.values())
    assert (w["updates_sent"], w["bytes_up"], w["bytes_up_raw"]) == (1, len(body), 4 * numel)
    assert (w["pulls"], w["bytes_down"], w["bytes_down_raw"]) == (1, len(pulled.data), 4 * numel)


@pytest.mark.parametrize("strategy", ["ties", "dare", "task_arithmetic"])
def test_gateway_strategy_is_configurable(make_app, strategy):
    client = make_app(gateway_strategy=strategy).test_client()
    put_expert(client, "a", make_adapter(seed=1))
    put_expert(client, "b", make_adapter(seed=2))
    info = client.get("/api/v1/gateway").get_json()
    assert info["strategy"] == strategy and info["lora"]["rank"] >= 2
    assert client.get("/api/v1/gateway/weights").status_code == 200


def test_unknown_gateway_strategy_is_refused_at_start(make_app):
    with pytest.raises(ValueError, match="--gateway-strategy must be one of"):
        make_app(gateway_strategy="median")
