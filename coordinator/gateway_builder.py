"""The gateway model: every expert merged into one adapter, rebuilt when one changes.

Built lazily on request and cached by a key over (strategy, weights, source
versions), so asking twice costs nothing and a restart reuses the stored blob.
The default merge (``weighted_average``) concatenates ranks and is exact:
B_g @ A_g == sum_i w_i * B_i @ A_i * scale_i. Full-parameter experts are averaged
exactly too (sum_i w_i W_i, weights summing to 1), one tensor at a time; a mix of full
and LoRA experts is refused with a 409 that says how to pick one kind.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from coordinator.adapters import non_finite_tensor
from gateway.errors import MergeError
from gateway.files import SAFETENSORS_META_KEY
from gateway.lora import split_modules
from gateway.merges import merge
from protocol.errors import Conflict, NotFound
from protocol.schemas import ExpertSpec
from protocol.streaming import FileTensors
from protocol.tensors import load_file, save_file

if TYPE_CHECKING:
    from coordinator.service import Coordinator
    from coordinator.store import ExpertRow

def gateway_weights(experts: list["ExpertRow"], configured: dict[str, float] | None) -> dict[str, float]:
    """Normalised per-expert weights: configured ones, else proportional to samples seen."""
    if configured:
        raw = {e.name: float(configured.get(e.name, 0.0)) for e in experts}
    else:
        raw = {e.name: float(e.samples_seen) for e in experts}
    total = sum(raw.values())
    if total <= 0:  # nothing trained yet, or weights for absent experts only: equal weights
        return {name: 1.0 / len(raw) for name in raw}
    return {name: w / total for name, w in raw.items()}


class GatewayBuilder:
    def __init__(self, coordinator: "Coordinator") -> None:
        self._c = coordinator
        self._lock = threading.Lock()

    def current(self) -> dict[str, Any]:
        """The gateway for the experts as they are now, building it if needed."""
        experts = self._c.db.experts()
        if not experts:
            raise NotFound("there is no gateway yet: no expert exists (start a worker first)")
        weights = gateway_weights(experts, dict(self._c.config.gateway_weights or {}))
        strategy = self._c.config.gateway_strategy
        sources = {e.name: e.version for e in experts}
        key = hashlib.sha256(json.dumps([strategy, weights, sources], sort_keys=True).encode()).hexdigest()
        with self._lock:
            stored = self._c.db.gateway(key)
            if stored is None:
                self._build(key, strategy, weights, experts)
                stored = self._c.db.gateway(key)
        assert stored is not None
        return stored

    def _build(self, key: str, strategy: str, weights: dict[str, float], experts: list["ExpertRow"]) -> None:
        used = [e for e in experts if weights[e.name] > 0]
        specs = {e.name: ExpertSpec.from_json(e.spec) for e in used}
        fingerprints = {s.base_model.fingerprint for s in specs.values()}
        if len(fingerprints) > 1:
            raise Conflict("experts were trained from different base models and cannot be merged: "
                           + ", ".join(f"{n}: {s.base_model.id}" for n, s in specs.items()))
        if any(s.kind == "full" for s in specs.values()):
            return self._build_full(key, strategy, weights, experts, used, specs)
        try:
            modules = [split_modules(load_file(self._c.weights(e.name).path), specs[e.name].lora.alpha,
                                     specs[e.name].lora.rank) for e in used]
            result = merge(strategy, modules, [weights[e.name] for e in used])
        except MergeError as exc:
            raise Conflict(f"cannot build the gateway with {strategy!r}: {exc}") from None
        tensors, alpha, rank = result.state_dict()
        _check_finite(tensors)
        first = next(iter(specs.values()))
        info = {"strategy": strategy, "weights": weights, "kind": "lora",
                "sources": {e.name: e.version for e in experts},
                "lora": {"rank": rank, "alpha": alpha, "target_modules": list(first.lora.target_modules)},
                "base_model": {"id": first.base_model.id, "fingerprint": first.base_model.fingerprint},
                "truncation_error": result.truncation_error}
        meta = {SAFETENSORS_META_KEY: json.dumps(info)}
        self._store(key, info, lambda p: save_file(tensors, p, meta))

    def _store(self, key: str, info: dict[str, Any], write: Callable[[Path], None]) -> None:
        """Write the gateway's blob, then its row; a row that cannot be committed leaves no blob behind."""
        written = self._c.blobs.write_temp(write)
        with self._c.blobs_guard:  # adopt and record together: see Coordinator.blobs_guard
            digest = self._c.blobs.adopt(written)
            try:
                self._c.db.add_gateway(key, digest, info)
            except BaseException:
                self._c.drop_unreferenced([digest])
                raise


    def _build_full(self, key: str, strategy: str, weights: dict[str, float], experts: list["ExpertRow"],
                    used: list["ExpertRow"], specs: dict[str, ExpertSpec]) -> None:
        """The exact weighted average of full-parameter experts, accumulated in place."""
        lora = sorted(n for n, s in specs.items() if s.kind == "lora")
        if lora:
            full = sorted(n for n, s in specs.items() if s.kind == "full")
            raise Conflict(f"cannot merge full-parameter experts {full} with LoRA experts {lora}; give one kind "
                           "zero weight with the coordinator flag --gateway-weights (e.g. "
                           f"--gateway-weights {','.join(f'{n}=1' for n in full)}), or use one expert "
                           "(get_gateway_model.py --expert NAME)")
        if strategy != "weighted_average":
            raise Conflict(f"gateway strategy {strategy!r} needs LoRA experts; full-parameter experts are "
                           "merged with --gateway-strategy weighted_average")
        total: dict[str, torch.Tensor] = {}
        for e in used:  # one model in memory plus one tensor, however many experts
            tensors = FileTensors(self._c.weights(e.name).path)
            for name in tensors:
                if name in total:
                    total[name].add_(tensors[name], alpha=weights[e.name])
                else:
                    total[name] = tensors[name].mul_(weights[e.name])
        _check_finite(total)
        first = specs[used[0].name]
        info = {"strategy": strategy, "weights": weights, "kind": "full",
                "sources": {e.name: e.version for e in experts}, "lora": None,
                "full": {"num_parameters": first.full.num_parameters if first.full else 0},
                "base_model": {"id": first.base_model.id, "fingerprint": first.base_model.fingerprint},
                "truncation_error": 0.0}
        self._store(key, info, lambda p: save_file(total, p, {SAFETENSORS_META_KEY: json.dumps(info)}))


def _check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """Finite experts can still merge to Inf (LoRA factors are scaled by alpha / rank): refuse, never store it."""
    bad = non_finite_tensor(tensors)
    if bad is not None:
        raise Conflict(f"the merged gateway's tensor {bad!r} overflows float32 (Inf/NaN): an expert's weights are "
                       "too large to merge; use one expert (get_gateway_model.py --expert NAME) or give it less "
                       "weight (--gateway-weights)", reason="gateway_not_finite", tensor=bad)
