"""Full-parameter experts on the coordinator: created, checked, aggregated and merged like LoRA ones."""
from __future__ import annotations


import pytest
import torch

from protocol.schemas import ExpertSpec
from protocol.errors import BadRequest
from protocol.tensors import loads
from tests.helpers import FINGERPRINT, expert_spec, make_adapter, push, put_expert, update_meta


def full_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(7, 4, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g),
            "model.norm.weight": torch.randn(4, generator=g)}


def full_spec(num_parameters: int = 7 * 4 + 6 * 4 + 4) -> dict:
    return {"kind": "full", "full": {"num_parameters": num_parameters},
            "base_model": {"id": "tiny-test", "fingerprint": FINGERPRINT}}


def test_spec_kinds_are_distinct_and_validated():
    full = ExpertSpec.from_json(full_spec())
    assert (full.kind, full.lora, full.full.num_parameters) == ("full", None, 56)
    assert ExpertSpec.from_json(full.to_json()) == full
    lora = ExpertSpec.from_json(expert_spec())
    assert lora.kind == "lora" and lora.full is None and lora.to_json()["kind"] == "lora"
    with pytest.raises(BadRequest, match='takes no "lora"'):
        ExpertSpec.from_json(full_spec() | {"lora": expert_spec()["lora"]})
    with pytest.raises(BadRequest, match="kind must be one of"):
        ExpertSpec.from_json(full_spec() | {"kind": "half"})
    with pytest.raises(BadRequest, match="num_parameters must be >= 1"):
        ExpertSpec.from_json(full_spec(0))
    with pytest.raises(BadRequest, match='"kind": "full"'):
        ExpertSpec.from_json(expert_spec(rank=0))


def test_full_expert_is_created_and_fedasync_applies_updates_exactly(client):
    weights = full_weights()
    r = put_expert(client, "full_x", weights, full_spec())
    assert r.status_code == 201, r.get_json()
    assert r.get_json()["kind"] == "full" and r.get_json()["lora"] is None
    delta = full_weights(seed=1)
    assert push(client, "full_x", delta, update_meta(num_samples=3)).status_code == 202
    got = loads(client.get("/api/v1/experts/full_x/weights").data)
    for name in weights:
        torch.testing.assert_close(got[name], weights[name] + delta[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("tensors, spec, message", [
    (full_weights(), full_spec(55), "hold 56 parameters, but the spec says num_parameters 55"),
    (make_adapter(), full_spec(sum(t.numel() for t in make_adapter().values())), "is a LoRA factor"),
    (full_weights() | {"model.norm.weight": torch.tensor([1.0, float("nan"), 0.0, 0.0])}, full_spec(),
     "contains NaN or Inf"),
    ({k: v.double() for k, v in full_weights().items()}, full_spec(), "expected float32"),
])
def test_full_expert_weights_are_checked_against_the_spec(client, tensors, spec, message):
    r = put_expert(client, "full_x", tensors, spec)
    assert r.status_code == 422 and message in r.get_json()["error"]["message"], r.get_json()


def test_update_that_does_not_fit_the_manifest_is_refused(client):
    put_expert(client, "full_x", full_weights(), full_spec())
    bad = full_weights(1)
    bad["model.norm.weight"] = torch.zeros(5)
    r = push(client, "full_x", bad)
    assert r.status_code == 422 and "shape [5], expected [4]" in r.get_json()["error"]["message"]
    assert push(client, "full_x", {}, body=b"\x08" + b"\x00" * 7 + b"{}").status_code == 400


def test_a_lora_worker_cannot_join_a_full_expert(client):
    put_expert(client, "full_x", full_weights(), full_spec())
    r = put_expert(client, "full_x", make_adapter(), expert_spec())
    assert r.status_code == 409 and "kind 'lora' != expert's 'full'" in r.get_json()["error"]["message"]


def test_gateway_of_full_experts_is_their_exact_weighted_average(make_app):
    app = make_app(gateway_weights={"a": 3.0, "b": 1.0})
    client = app.test_client()
    put_expert(client, "a", full_weights(0), full_spec())
    put_expert(client, "b", full_weights(1), full_spec())
    info = client.get("/api/v1/gateway").get_json()
    assert info["kind"] == "full" and info["lora"] is None and info["weights"] == {"a": 0.75, "b": 0.25}
    got = loads(client.get("/api/v1/gateway/weights").data)
    for name, t in full_weights(0).items():
        torch.testing.assert_close(got[name], 0.75 * t + 0.25 * full_weights(1)[name], rtol=0, atol=1e-6)


def test_gateway_refuses_to_mix_full_and_lora_experts_and_names_the_fix(client):
    put_expert(client, "full_x", full_weights(), full_spec())
    put_expert(client, "lora_y", make_adapter())
    r = client.get("/api/v1/gateway")
    message = r.get_json()["error"]["message"]
    assert r.status_code == 409 and "--gateway-weights full_x=1" in message and "lora_y" in message


def test_mixed_experts_merge_once_one_kind_has_zero_weight(make_app):
    client = make_app(gateway_weights={"full_x": 1.0}).test_client()
    put_expert(client, "full_x", full_weights(), full_spec())
    put_expert(client, "lora_y", make_adapter())
    assert client.get("/api/v1/gateway").get_json()["kind"] == "full"
