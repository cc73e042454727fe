"""Codecs by name, and ``make_codec`` to build one (or a pipeline) from a spec."""
from __future__ import annotations

import dataclasses
from typing import Any

from compression.base import Codec
from compression.codecs.blockwise import Int4, Int8
from compression.codecs.casts import BFloat16, Float16, RawFloat32
from compression.codecs.natural import Natural
from compression.codecs.powersgd import PowerSGD
from compression.codecs.qsgd import QSGD
from compression.codecs.randomk import RandomK
from compression.codecs.signsgd import SignSGD
from compression.codecs.terngrad import TernGrad
from compression.codecs.threshold import Threshold
from compression.codecs.topk import TopK
from compression.config import build_config
from compression.errors import CompressionError
from compression.pipeline import Pipeline

CODECS: dict[str, type[Codec]] = {
    cls.name: cls
    for cls in (
        RawFloat32, Float16, BFloat16, Int8, Int4, QSGD, Natural, TernGrad, SignSGD,
        TopK, RandomK, Threshold, PowerSGD,
    )
}


def make_codec(spec: str, config: dict[str, Any] | None = None) -> Codec:
    """Build a codec from ``"name"`` or ``"sparsifier+quantizer"``.

    A single codec takes its options as a flat mapping (``{"ratio": 0.01}``);
    a pipeline takes one mapping per stage (``{"topk": {"ratio": 0.01}}``).
    """
    if not isinstance(spec, str):
        raise CompressionError(f"codec spec must be a string, got {type(spec).__name__}")
    stages = [name.strip() for name in spec.split("+")]
    if len(stages) == 1:
        return _build(stages[0], config)
    if len(stages) == 2:
        return _build_pipeline(stages, config)
    raise CompressionError(f"a pipeline is one sparsifier and one quantizer (e.g. 'topk+int8'), got {spec!r}")


def _build(name: str, config: dict[str, Any] | None) -> Codec:
    cls = CODECS.get(name)
    if cls is None:
        raise CompressionError(f"unknown codec {name!r}; valid codecs: {', '.join(sorted(CODECS))}")
    if config is not None and not isinstance(config, dict):
        raise CompressionError(f"config for codec {name!r} must be a dict, got {type(config).__name__}")
    return cls(build_config(cls.config_class, config, name))


def _build_pipeline(stages: list[str], config: dict[str, Any] | None) -> Pipeline:
    """Build ``sparsifier+quantizer``; config is per stage or flat (each key goes to the stage that has it)."""
    config = config or {}
    if not isinstance(config, dict):
        raise CompressionError(f"pipeline config must be a dict, got {type(config).__name__}")
    per_stage = config if all(key in stages for key in config) else _route_flat(stages, config)
    sparsifier, quantizer = (_build(name, per_stage.get(name)) for name in stages)
    return Pipeline(sparsifier, quantizer)


def _route_flat(stages: list[str], config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"ratio": 0.01, "block_size": 32}`` for topk+int8 -> {"topk": {"ratio": ...}, "int8": {...}}."""
    fields = {name: {f.name for f in dataclasses.fields(CODECS[name].config_class)}
              for name in stages if name in CODECS}
    routed: dict[str, dict[str, Any]] = {name: {} for name in stages}
    for key, value in config.items():
        owners = [name for name, names in fields.items() if key in names]
        if len(owners) != 1:
            problem = "is ambiguous" if owners else "belongs to no stage"
            raise CompressionError(
                f"config key {key!r} {problem} in pipeline {'+'.join(stages)!r}; "
                "give each stage its own mapping, e.g. {'topk': {'ratio': 0.01}, 'int8': {'block_size': 64}}"
            )
        routed[owners[0]][key] = value
    return routed
