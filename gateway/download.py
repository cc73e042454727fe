"""Fetch an adapter from a coordinator: the gateway, one expert, or the experts merged locally."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.build import Source, build_gateway
from protocol.client import CoordinatorClient
from protocol.errors import NotFound
from protocol.schemas import ExpertSpec
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
    """The gateway of the experts as they are now (its tensors: the newest built, the same one unless
    a push lands in between)."""
    info = client.gateway.info(fresh=True)
    tensors = client.gateway.tensors()
    return Adapter(tensors, info["lora"], info["base_model"], {"kind": "gateway", **info})


def fetch_expert(client: CoordinatorClient, name: str) -> Adapter:
    info = client.experts.get(name)
    pulled = client.experts.pull(name)
    assert pulled.tensors is not None
    public: dict[str, Any] = {k: info[k] for k in ("name", "version", "updates_applied", "samples_seen") if k in info}
    return Adapter(pulled.tensors, info["lora"], info["base_model"], {"kind": "expert", **public})


def merge_experts(client: CoordinatorClient, strategy: str, config: dict[str, Any] | None = None) -> Adapter:
    """Merge the experts here with ``strategy`` and its settings ``config``, by gateway.build as the
    coordinator does, weighted as in the coordinator's newest gateway (GET /gateway only reads)."""
    weights = client.gateway.info()["weights"]
    used = [name for name, w in weights.items() if w > 0]
    if not used:
        raise NotFound("no expert has a positive gateway weight")
    built = build_gateway([_source(client, name, strategy) for name in used], weights, strategy, config)
    info = built.info | {"kind": "gateway", "merged_locally": True}
    return Adapter(built.tensors, built.info["lora"], built.info["base_model"], info)


def _source(client: CoordinatorClient, name: str, strategy: str) -> Source:
    spec = ExpertSpec.from_json(client.experts.get(name))
    if spec.kind == "full":
        raise ValueError(f"--strategy {strategy}: the experts are full-parameter; their gateway is their exact "
                         "weighted average (drop --strategy), or pick one with --expert")
    pulled = client.experts.pull(name)
    tensors = pulled.tensors
    assert tensors is not None
    return Source(name, pulled.version, spec, lambda: tensors)
