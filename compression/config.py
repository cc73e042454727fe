"""Validation helpers shared by the codec config dataclasses."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Iterable

from compression.errors import CompressionError


@dataclasses.dataclass(frozen=True)
class NoConfig:
    """Config of a codec that has no options."""


def require_int(field: str, value: Any, low: int, high: int | None = None) -> None:
    """Raise unless ``low <= value <= high`` and ``value`` is an int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise CompressionError(f"{field} must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise CompressionError(f"{field} must be {bound}, got {value!r}")


def require_real(
    field: str, value: Any, low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> None:
    """Raise unless ``value`` is a finite number inside the given interval."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise CompressionError(f"{field} must be a finite number in {interval}, got {value!r}")
    value = float(value)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        raise CompressionError(f"{field} must be in {interval}, got {value!r}")


def require_choice(field: str, value: Any, choices: Iterable[str]) -> None:
    """Raise unless ``value`` is one of ``choices``."""
    choices = sorted(choices)
    if value not in choices:
        raise CompressionError(f"{field} must be one of {choices}, got {value!r}")


def build_config(config_class: type, values: dict[str, Any] | None, owner: str) -> Any:
    """Instantiate ``config_class`` from a plain mapping, rejecting unknown keys."""
    values = dict(values or {})
    valid = [f.name for f in dataclasses.fields(config_class)]
    for key in values:
        if key not in valid:
            raise CompressionError(
                f"unknown config key {key!r} for codec {owner!r}; valid keys: {valid or 'none'}"
            )
    return config_class(**values)
