"""LoRA adapters as per-module factor pairs, to and from PEFT state dicts.

PEFT stores a module's update as two tensors, `<prefix>.lora_A.weight` (r x in) and
`<prefix>.lora_B.weight` (out x r), and applies B @ A * alpha / r. Merges work on
`LoraModule`s, which carry their own scale so that experts of different rank and alpha can be
combined without losing track of which scale belongs to which factors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from gateway.errors import MergeError

A_SUFFIX = ".lora_A.weight"
B_SUFFIX = ".lora_B.weight"


# eq=False: comparing tensors with == is elementwise, so dataclass equality would be ambiguous.
@dataclass(frozen=True, eq=False)
class LoraModule:
    """One module's low-rank update: delta = B @ A * scale."""

    A: Tensor
    """Down projection, shape (rank, in_features)."""
    B: Tensor
    """Up projection, shape (out_features, rank)."""
    scale: float
    """Multiplier PEFT applies to B @ A (alpha / rank)."""

    def __post_init__(self) -> None:
        if self.A.ndim != 2 or self.B.ndim != 2:
            raise MergeError(
                f"LoRA factors must be 2-D, got A {tuple(self.A.shape)} and B {tuple(self.B.shape)}"
            )
        if self.B.shape[1] != self.A.shape[0]:
            raise MergeError(
                f"B has {self.B.shape[1]} columns but A has {self.A.shape[0]} rows; "
                "they must both equal the LoRA rank"
            )
        if not math.isfinite(self.scale):
            raise MergeError(f"scale must be finite, got {self.scale!r}")

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features) of the full update."""
        return self.B.shape[0], self.A.shape[1]

    def delta(self) -> Tensor:
        """The full update B @ A * scale, shape (out_features, in_features)."""
        return (self.B @ self.A) * self.scale


def split_modules(state: dict[str, Tensor], alpha: float, rank: int) -> dict[str, LoraModule]:
    """Pair a PEFT adapter state dict into modules keyed by prefix, each with scale alpha / rank."""
    _check_lora_config(alpha, rank)
    factors: dict[str, dict[str, Tensor]] = {}
    for key, tensor in state.items():
        prefix, which = _parse_key(key)
        if tensor.ndim != 2 or not tensor.is_floating_point():
            raise MergeError(
                f"{key!r} must be a 2-D floating tensor, got shape {tuple(tensor.shape)} "
                f"dtype {tensor.dtype}"
            )
        factors.setdefault(prefix, {})[which] = tensor
    if not factors:
        raise MergeError(
            "adapter state dict is empty; export it with peft.get_peft_model_state_dict"
        )
    return {prefix: _pair(prefix, pair, alpha, rank) for prefix, pair in factors.items()}


def join_modules(modules: dict[str, LoraModule]) -> tuple[dict[str, Tensor], float, int]:
    """Back to a PEFT state dict plus (alpha, rank) that reproduces every module exactly.

    PEFT needs one rank per adapter, so every module is padded with zero rows of A and zero
    columns of B up to the largest rank (zeros add nothing to B @ A). Each module's scale is
    folded into B and alpha = rank, so PEFT's alpha / rank is 1.
    """
    if not modules:
        raise MergeError("no modules to join; the merge produced an empty adapter")
    # PEFT rejects r=0, so an all-empty merge still gets one (zero) rank.
    rank = max(1, max(module.rank for module in modules.values()))
    state: dict[str, Tensor] = {}
    for prefix, module in modules.items():
        pad = rank - module.rank
        A = module.A.float()
        B = module.B.float() * module.scale
        if pad:
            A = torch.cat([A, A.new_zeros(pad, A.shape[1])], dim=0)
            B = torch.cat([B, B.new_zeros(B.shape[0], pad)], dim=1)
        # safetensors needs contiguous tensors; re-factorised A is often a transposed view.
        state[prefix + A_SUFFIX] = A.contiguous()
        state[prefix + B_SUFFIX] = B.contiguous()
    return state, float(rank), rank


def _check_lora_config(alpha: float, rank: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise MergeError(f"rank must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise MergeError(f"alpha must be a positive number, got {alpha!r}")
    if not math.isfinite(alpha):
        raise MergeError(f"alpha must be finite, got {alpha!r}")


def _parse_key(key: str) -> tuple[str, str]:
    for suffix, which in ((A_SUFFIX, "A"), (B_SUFFIX, "B")):
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)], which
    raise MergeError(
        f"{key!r} is not a LoRA factor: keys must end in {A_SUFFIX!r} or {B_SUFFIX!r} "
        "(adapters with modules_to_save, DoRA or LoRA biases cannot be merged)"
    )


def _pair(prefix: str, pair: dict[str, Tensor], alpha: float, rank: int) -> LoraModule:
    for which, suffix in (("A", A_SUFFIX), ("B", B_SUFFIX)):
        if which not in pair:
            other = B_SUFFIX if which == "A" else A_SUFFIX
            raise MergeError(f"{prefix + other!r} has no matching {prefix + suffix!r}")
    A, B = pair["A"], pair["B"]
    if A.shape[0] != rank:
        raise MergeError(f"{prefix + A_SUFFIX!r} has {A.shape[0]} rows, expected rank {rank}")
    if B.shape[1] != rank:
        raise MergeError(f"{prefix + B_SUFFIX!r} has {B.shape[1]} columns, expected rank {rank}")
    return LoraModule(A=A.float(), B=B.float(), scale=alpha / rank)
