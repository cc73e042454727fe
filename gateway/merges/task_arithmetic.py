"""Task arithmetic (Ilharco et al. 2023, "Editing Models with Task Arithmetic").

dW = lam * sum_i w_i * dW_i. Being linear in the dW_i, it is built exactly by concatenating
ranks with coefficients lam * w_i, like the weighted average, never through a dense SVD.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gateway.merges.base import (
    Expert,
    MergeResult,
    check_experts,
    check_finite,
    check_rank,
    check_weights,
    merge_by_concatenation,
    parse_config,
)

NAME = "task_arithmetic"


@dataclass(frozen=True)
class TaskArithmeticConfig:
    """Settings of task arithmetic."""

    lam: float = 1.0
    """Scaling lambda applied to the summed task vectors (`lambda` is a Python keyword)."""
    rank: int | None = None
    """Truncate each module to this rank by SVD (error reported); None keeps it exact."""

    def __post_init__(self) -> None:
        check_finite("lam", self.lam)
        check_rank(self.rank)


def task_arithmetic(experts: list[Expert], weights: list[float], **config: Any) -> MergeResult:
    """lam * sum_i w_i * dW_i. Weights are NOT normalised; a negative weight subtracts an expert."""
    cfg = parse_config(TaskArithmeticConfig, config, NAME)
    check_experts(experts)
    applied = check_weights(weights, len(experts))
    coeffs = [cfg.lam * w for w in applied]
    return merge_by_concatenation(NAME, experts, coeffs, applied, cfg.rank, asdict(cfg))
