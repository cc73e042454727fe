"""Build a gateway: the experts merged into one adapter (or one full model) plus its description.

One build for both sides: the coordinator's background builder (coordinator/gateway_builder.py)
and the local merge of ``get_gateway_model.py --strategy`` (gateway/download.py). LoRA experts
go through a merge of gateway.merges with the strategy's settings; full-parameter experts are
averaged exactly (sum_i w_i W_i, weights summing to 1), one tensor at a time, so memory holds one
model plus one tensor however many experts there are. A mix of the two kinds is refused.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gateway.errors import MergeError
from gateway.lora import split_modules
from gateway.merges import merge
from protocol.schemas import ExpertSpec


@dataclass(frozen=True)
class Source:
    """One expert going into a gateway."""

    name: str
    version: int
    spec: ExpertSpec
    tensors: Callable[[], Mapping[str, Tensor]]
    """Loads the expert's tensors; called only when its weight is positive. A full expert's may be
    a lazy per-tensor view of its file (protocol.streaming.FileTensors)."""


@dataclass(frozen=True)
class Built:
    """A gateway's tensors and the JSON that describes them (also stored in the file's metadata)."""

    tensors: dict[str, Tensor]
    info: dict[str, Any]


def gateway_weights(samples: Mapping[str, int], configured: Mapping[str, float] | None) -> dict[str, float]:
    """Normalised per-expert weights: the configured ones, else proportional to samples seen."""
    if configured:
        raw = {name: float(configured.get(name, 0.0)) for name in samples}
    else:
        raw = {name: float(n) for name, n in samples.items()}
    total = sum(raw.values())
    if total <= 0:  # nothing trained yet, or weights for absent experts only: equal weights
        return {name: 1.0 / len(raw) for name in raw}
    return {name: w / total for name, w in raw.items()}


def build_gateway(sources: list[Source], weights: Mapping[str, float], strategy: str,
                  settings: Mapping[str, Any] | None = None) -> Built:
    """Merge the sources with a positive weight; MergeError says why they cannot be merged."""
    used = [s for s in sources if weights[s.name] > 0]
    if not used:
        raise MergeError("no expert has a positive gateway weight; give one a weight (--gateway-weights)")
    fingerprints = {s.spec.base_model.fingerprint for s in used}
    if len(fingerprints) > 1:
        raise MergeError("experts were trained from different base models and cannot be merged: "
                         + ", ".join(f"{s.name}: {s.spec.base_model.id}" for s in used))
    first = used[0].spec
    info: dict[str, Any] = {"strategy": strategy, "weights": dict(weights),
                            "sources": {s.name: s.version for s in sources},
                            "base_model": {"id": first.base_model.id, "fingerprint": first.base_model.fingerprint}}
    if any(s.spec.kind == "full" for s in used):
        return _average_full(used, weights, strategy, dict(settings or {}), info)
    return _merge_lora(used, weights, strategy, dict(settings or {}), info)


def _merge_lora(used: list[Source], weights: Mapping[str, float], strategy: str, settings: dict[str, Any],
                info: dict[str, Any]) -> Built:
    specs = [s.spec.lora for s in used]
    assert all(spec is not None for spec in specs)
    modules = [split_modules(dict(s.tensors()), spec.alpha, spec.rank)  # type: ignore[union-attr]
               for s, spec in zip(used, specs)]
    try:
        result = merge(strategy, modules, [weights[s.name] for s in used], **settings)
    except MergeError as exc:
        raise MergeError(f"cannot build the gateway with {strategy!r}: {exc}") from None
    tensors, alpha, rank = result.state_dict()
    target_modules = list(specs[0].target_modules)  # type: ignore[union-attr]
    info |= {"kind": "lora", "config": result.config, "truncation_error": result.truncation_error,
             "lora": {"rank": rank, "alpha": alpha, "target_modules": target_modules}}
    return Built(tensors, info)


def _average_full(used: list[Source], weights: Mapping[str, float], strategy: str, settings: dict[str, Any],
                  info: dict[str, Any]) -> Built:
    """The exact weighted average of full-parameter experts, accumulated in place."""
    lora = sorted(s.name for s in used if s.spec.kind == "lora")
    if lora:
        full = sorted(s.name for s in used if s.spec.kind == "full")
        raise MergeError(f"cannot merge full-parameter experts {full} with LoRA experts {lora}; give one kind "
                         "zero weight with the coordinator flag --gateway-weights (e.g. "
                         f"--gateway-weights {','.join(f'{n}=1' for n in full)}), or use one expert "
                         "(get_gateway_model.py --expert NAME)")
    if strategy != "weighted_average" or settings.get("rank") is not None:
        raise MergeError(f"gateway strategy {strategy!r} with settings {settings} needs LoRA experts; "
                         "full-parameter experts are merged with --gateway-strategy weighted_average and "
                         "no --gateway-config")
    total: dict[str, Tensor] = {}
    for source in used:  # one model in memory plus one tensor, however many experts
        tensors, w = source.tensors(), weights[source.name]
        for name in tensors:
            if name in total:
                total[name].add_(tensors[name], alpha=w)
            else:
                total[name] = torch.mul(tensors[name], w)  # a new tensor: the caller's stay untouched
    full_spec = used[0].spec.full
    info |= {"kind": "full", "config": {}, "truncation_error": 0.0, "lora": None,
             "full": {"num_parameters": full_spec.num_parameters if full_spec else 0}}
    return Built(total, info)
