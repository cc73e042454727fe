"""Weighted average of the experts' full updates, exact by concatenating ranks.

sum_i w_i * B_i @ A_i * s_i == [w_1 s_1 B_1, ..., w_n s_n B_n] @ [A_1; ...; A_n], so the
average costs nothing but rank (sum of the experts' ranks). Averaging A and B separately
instead is wrong: mean(B_i) @ mean(A_i) != mean(B_i @ A_i) (docs/architecture.md, "Exact gateway").
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gateway.errors import MergeError
from gateway.merges.base import (
    Expert,
    MergeResult,
    check_experts,
    check_rank,
    check_weights,
    merge_by_concatenation,
    parse_config,
)

NAME = "weighted_average"


@dataclass(frozen=True)
class WeightedAverageConfig:
    """Settings of the weighted average."""

    rank: int | None = None
    """Truncate each module to this rank by SVD (error reported); None keeps it exact."""

    def __post_init__(self) -> None:
        check_rank(self.rank)


def weighted_average(experts: list[Expert], weights: list[float], **config: Any) -> MergeResult:
    """sum_i w_i * dW_i with the weights normalised to sum 1 (so [2, 2] means [0.5, 0.5]).

    Weights must be non-negative and not all zero; the result's `weights` are the normalised ones.
    """
    cfg = parse_config(WeightedAverageConfig, config, NAME)
    check_experts(experts)
    raw = check_weights(weights, len(experts))
    for i, w in enumerate(raw):
        if w < 0:
            raise MergeError(
                f"weights[{i}] is {w!r}; an average needs non-negative weights "
                "(use 'task_arithmetic' to subtract an expert)"
            )
    total = sum(raw)
    applied = [w / total for w in raw]
    return merge_by_concatenation(NAME, experts, applied, applied, cfg.rank, asdict(cfg))
