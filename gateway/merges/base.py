"""What every merge shares: the result type, input checks, config parsing, and the two drivers.

A merge combines the full updates dW_i = B_i @ A_i * s_i of several experts, module by module.
Two drivers cover every strategy:

- `merge_by_concatenation`: the merged update is a linear combination sum_i c_i dW_i, built
  exactly by stacking ranks and optionally truncated by SVD of the small core;
- `merge_densely`: the strategy needs the dense dW_i (trimming, random drops, sign votes), so
  each module is merged dense and re-factorised to a rank by SVD.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from numbers import Real
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from gateway.errors import MergeError
from gateway.lora import LoraModule, join_modules
from gateway.lowrank import Refactorised, concatenate, sketch_factorise, truncate

Expert = dict[str, LoraModule]


class Scratch:
    """Dense buffers reused from module to module within one merge, one per role.

    A fresh multi-megabyte tensor costs page faults on first touch: forming a rank-8 update into
    a new 1536 x 576 tensor took 1.6 ns per entry on one thread, into a reused one 0.8 ns. Each
    role's buffer grows to the largest module asked for (memory: roles x largest module); its
    contents are whatever its last user left, so every user overwrites it.
    """

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self._buffers: dict[str, Tensor] = {}

    def __call__(self, role: str, shape: torch.Size | tuple[int, ...]) -> Tensor:
        numel = math.prod(shape)
        buffer = self._buffers.get(role)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[role] = torch.empty(numel, dtype=self.dtype)
        return buffer[:numel].view(shape)


DenseCombine = Callable[[str, list[Tensor], Scratch], Tensor]
"""(module name, weighted dense updates w_i * dW_i, scratch buffers) -> merged dense update.

The updates are scratch buffers the combine may overwrite; it may return one of them or another
scratch buffer (the merged update is re-factorised before the next module is formed)."""


@dataclass(frozen=True, eq=False)
class MergeResult:
    """A merged adapter and how it was made."""

    modules: dict[str, LoraModule]
    """Merged factors per module name."""
    strategy: str
    """Name of the merge in MERGES."""
    weights: list[float]
    """Expert weights as applied (after normalisation, for merges that normalise)."""
    config: dict[str, Any]
    """Strategy settings, defaults included."""
    truncation_error: float | None = None
    """||dW - merged||_F / ||dW||_F over all modules after re-factorisation; None if exact."""
    module_errors: dict[str, float] = field(default_factory=dict)
    """The same relative error per module (empty when exact)."""

    def state_dict(self) -> tuple[dict[str, Tensor], float, int]:
        """PEFT state dict plus (alpha, rank) reproducing every merged module."""
        return join_modules(self.modules)


class MergeFn(Protocol):
    """A merge strategy: pure function of the experts, their weights and its own settings."""

    def __call__(
        self, experts: list[Expert], weights: list[float], **config: Any
    ) -> MergeResult: ...


C = TypeVar("C")


def parse_config(cls: type[C], config: Mapping[str, Any], strategy: str) -> C:
    """Build a strategy's config dataclass, refusing keys it does not know."""
    valid = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    for key in config:
        if key not in valid:
            raise MergeError(
                f"unknown config key {key!r} for merge {strategy!r}; "
                f"valid keys: {', '.join(valid) or '(none)'}"
            )
    return cls(**config)


def check_rank(rank: object) -> None:
    """rank: None or a positive int."""
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise MergeError(f"rank must be a positive integer or None, got {rank!r}")


def check_finite(name: str, value: object) -> None:
    """A real number (numpy scalars included), not a bool, not inf or nan."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise MergeError(f"{name} must be a finite number, got {value!r}")


def check_weights(weights: list[float], n_experts: int) -> list[float]:
    """Finite, one per expert, not all zero; returned as floats."""
    if len(weights) != n_experts:
        raise MergeError(f"got {len(weights)} weights for {n_experts} experts; give one per expert")
    for i, w in enumerate(weights):
        check_finite(f"weights[{i}]", w)
    if not any(weights):
        raise MergeError(f"weights are all zero ({list(weights)!r}); give some expert a weight")
    return [float(w) for w in weights]


def check_experts(experts: list[Expert]) -> list[str]:
    """Experts must adapt the same modules with the same shapes; returns the module names."""
    if not experts:
        raise MergeError("no experts to merge")
    first = experts[0]
    if not first:
        raise MergeError("expert 0 has no modules")
    for i, expert in enumerate(experts[1:], start=1):
        missing = first.keys() - expert.keys()
        extra = expert.keys() - first.keys()
        if missing or extra:
            key, verb = (min(missing), "lacks") if missing else (min(extra), "alone has")
            raise MergeError(
                f"expert {i} {verb} module {key!r}; experts must target the same modules "
                "of the same base model"
            )
        for name, module in expert.items():
            if module.shape != first[name].shape:
                raise MergeError(
                    f"module {name!r} is {module.shape} in expert {i} but {first[name].shape} "
                    "in expert 0; experts must share the base model"
                )
    return list(first)


def merge_by_concatenation(
    strategy: str,
    experts: list[Expert],
    coeffs: list[float],
    weights: list[float],
    rank: int | None,
    config: dict[str, Any],
) -> MergeResult:
    """sum_i coeffs[i] * dW_i exactly; with a rank, truncated by SVD and the error reported."""
    names = check_experts(experts)
    merged = {name: concatenate([e[name] for e in experts], coeffs) for name in names}
    if rank is None:
        return MergeResult(merged, strategy, weights, config)
    pieces = {name: truncate(module, rank) for name, module in merged.items()}
    return _refactorised_result(pieces, strategy, weights, config)


def merge_densely(
    strategy: str,
    experts: list[Expert],
    weights: list[float],
    combine: DenseCombine,
    rank: int | None,
    config: dict[str, Any],
) -> MergeResult:
    """Combine the dense w_i * dW_i per module, then re-factorise to `rank`.

    `rank` None means the sum of the experts' ranks for that module.
    """
    names = check_experts(experts)
    pieces: dict[str, Refactorised] = {}
    scratch = Scratch(experts[0][names[0]].A.dtype)
    for name in names:
        modules = [e[name] for e in experts]
        shape = modules[0].shape
        # Weight folded into B: one pass over the small factor instead of the dense update.
        deltas = [torch.mm(m.B * (m.scale * w), m.A, out=scratch(f"delta{i}", shape))
                  for i, (m, w) in enumerate(zip(modules, weights))]
        merged = combine(name, deltas, scratch)
        # The experts' row spaces seed the sketch: the merged update lies mostly within them.
        start = torch.cat([m.A for m in modules], dim=0).T
        pieces[name] = sketch_factorise(merged, rank or sum(m.rank for m in modules), start)
    return _refactorised_result(pieces, strategy, weights, config)


def _refactorised_result(
    pieces: dict[str, Refactorised], strategy: str, weights: list[float], config: dict[str, Any]
) -> MergeResult:
    total_error = math.sqrt(sum(p.error**2 for p in pieces.values()))
    total_norm = math.sqrt(sum(p.norm**2 for p in pieces.values()))
    return MergeResult(
        modules={name: p.module for name, p in pieces.items()},
        strategy=strategy,
        weights=weights,
        config=config,
        truncation_error=total_error / total_norm if total_norm > 0 else 0.0,
        module_errors={name: p.relative_error for name, p in pieces.items()},
    )
