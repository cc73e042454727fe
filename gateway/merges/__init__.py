"""Merge strategies for LoRA experts, chosen by name from MERGES.

Every strategy merges the experts' full updates dW_i = B_i @ A_i * s_i module by module
(never A and B separately) and returns LoRA factors PEFT can load.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from gateway.errors import MergeError
from gateway.merges.base import Expert, MergeFn, MergeResult, parse_config
from gateway.merges.dare import DareConfig, dare
from gateway.merges.dare_ties import dare_ties
from gateway.merges.task_arithmetic import TaskArithmeticConfig, task_arithmetic
from gateway.merges.ties import TiesConfig, ties
from gateway.merges.weighted_average import WeightedAverageConfig, weighted_average

MERGES: dict[str, MergeFn] = {
    "weighted_average": weighted_average,
    "task_arithmetic": task_arithmetic,
    "ties": ties,
    "dare": dare,
    "dare_ties": dare_ties,
}
SETTINGS: dict[str, type] = {
    "weighted_average": WeightedAverageConfig,
    "task_arithmetic": TaskArithmeticConfig,
    "ties": TiesConfig,
    "dare": DareConfig,
    "dare_ties": DareConfig,  # DARE-TIES takes DARE's settings
}
"""Each strategy's settings dataclass (its fields are the keys `merge` accepts)."""


def check_settings(name: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Validate `settings` for strategy `name` up front; returns them with defaults filled in.

    MergeError names the bad key or value and lists the valid keys, so a coordinator can refuse
    a bad --gateway-config at start rather than at its first gateway build.
    """
    if name not in SETTINGS:
        raise MergeError(f"unknown merge {name!r}; choose one of: {', '.join(MERGES)}")
    try:
        return asdict(parse_config(SETTINGS[name], settings, name))
    except TypeError as exc:  # a value of the wrong type the dataclass checks did not name
        raise MergeError(f"bad settings for merge {name!r}: {exc}") from None


def merge(name: str, experts: list[Expert], weights: list[float], **config: Any) -> MergeResult:
    """Merge `experts` with the strategy called `name`; config is that strategy's settings."""
    try:
        strategy = MERGES[name]
    except (KeyError, TypeError):
        raise MergeError(
            f"unknown merge {name!r}; choose one of: {', '.join(MERGES)}"
        ) from None
    return strategy(experts, weights, **config)


__all__ = ["MERGES", "SETTINGS", "MergeFn", "MergeResult", "check_settings", "merge"]
