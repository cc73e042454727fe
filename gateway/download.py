"""Fetch an adapter from a coordinator: the gateway, one expert, or the experts merged locally."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.lora import split_modules
from gateway.merges import merge
from protocol.client import CoordinatorClient
from protocol.errors import NotFound
from protocol.tensors import StateDict


@dataclass(frozen=True)
class Adapter:
    """LoRA tensors plus everything needed to use them."""

    tensors: StateDict
    lora: dict[str, Any] | None
    """{"rank", "alpha", "target_modules"}; the update is B @ A * alpha / rank. None: full-parameter
    weights (every weight of the model, keyed as ``named_parameters`` names them)."""
    base_model: dict[str, str]
    """{"id", "fingerprint"} of the model the adapter belongs to."""
    info: dict[str, Any] = field(default_factory=dict)
    """What this adapter is (gateway version, sources, strategy, or expert version)."""


def fetch_gateway(client: CoordinatorClient) -> Adapter:
    info = client.gateway_info()
    tensors = client.gateway_tensors()
    return Adapter(tensors, info["lora"], info["base_model"], {"kind": "gateway", **info})


def fetch_expert(client: CoordinatorClient, name: str) -> Adapter:
    info = client.expert(name)
    pulled = client.pull_weights(name)
    assert pulled.tensors is not None
    public = {k: info[k] for k in ("name", "version", "updates_applied", "samples_seen") if k in info}
    return Adapter(pulled.tensors, info["lora"], info["base_model"], {"kind": "expert", **public})


def merge_experts(client: CoordinatorClient, strategy: str, config: dict[str, Any] | None = None) -> Adapter:
    """Merge the experts here with ``strategy``, using the coordinator's gateway weights."""
    gateway = client.gateway_info()
    if gateway.get("lora") is None:
        raise ValueError(f"--strategy {strategy}: the experts are full-parameter; their gateway is their exact "
                       "weighted average (drop --strategy), or pick one with --expert")
    used = [name for name, w in gateway["weights"].items() if w > 0]
    if not used:
        raise NotFound("no expert has a positive gateway weight")
    experts = [fetch_expert(client, name) for name in used]
    modules = [split_modules(e.tensors, e.lora["alpha"], e.lora["rank"]) for e in experts]
    result = merge(strategy, modules, [gateway["weights"][n] for n in used], **(config or {}))
    tensors, alpha, rank = result.state_dict()
    lora = {"rank": rank, "alpha": alpha, "target_modules": gateway["lora"]["target_modules"]}
    info = {"kind": "gateway", "strategy": strategy, "config": result.config, "weights": gateway["weights"],
            "sources": {e.info["name"]: e.info["version"] for e in experts}, "lora": lora,
            "base_model": gateway["base_model"], "truncation_error": result.truncation_error,
            "merged_locally": True}
    return Adapter(tensors, lora, gateway["base_model"], info)
