"""Merge strategies for LoRA experts, chosen by name from MERGES.

Every strategy merges the experts' full updates dW_i = B_i @ A_i * s_i module by module
(never A and B separately) and returns LoRA factors PEFT can load.
"""
from __future__ import annotations

from typing import Any

from gateway.errors import MergeError
from gateway.merges.base import Expert, MergeFn, MergeResult
from gateway.merges.dare import dare
from gateway.merges.dare_ties import dare_ties
from gateway.merges.task_arithmetic import task_arithmetic
from gateway.merges.ties import ties
from gateway.merges.weighted_average import weighted_average

MERGES: dict[str, MergeFn] = {
    "weighted_average": weighted_average,
    "task_arithmetic": task_arithmetic,
    "ties": ties,
    "dare": dare,
    "dare_ties": dare_ties,
}


def merge(name: str, experts: list[Expert], weights: list[float], **config: Any) -> MergeResult:
    """Merge `experts` with the strategy called `name`; config is that strategy's settings."""
    try:
        strategy = MERGES[name]
    except (KeyError, TypeError):
        raise MergeError(
            f"unknown merge {name!r}; choose one of: {', '.join(MERGES)}"
        ) from None
    return strategy(experts, weights, **config)


__all__ = ["MERGES", "MergeFn", "MergeResult", "merge"]
