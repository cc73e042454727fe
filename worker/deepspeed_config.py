"""--deepspeed ds_config.json: the usual DeepSpeed JSON mapped onto this worker's own strategies.

The `deepspeed` package is not used (its engine would replace the trainer; see docs/bigger-workers.md).
What maps:

    zero_optimization.stage 0 -> ddp; 1 and 2 -> fsdp-grad-op (ZeRO-1 is run as ZeRO-2: gradients are
                                 sharded too); 3 -> fsdp
    offload_optimizer / offload_param {"device": "cpu"} -> --cpu-offload (FSDP2 offloads parameters,
                                 gradients and optimiser state together)
    fp16.enabled / bf16.enabled -> --precision fp16 / bf16 (fp16 with a dynamic loss scaler)
    gradient_clipping           -> max gradient norm (0 = no clipping)
    train_micro_batch_size_per_gpu x gradient_accumulation_steps x ranks -> --batch-size, --grad-accum
    train_batch_size            -> checked against that product

Purely tuning keys (bucket sizes, overlap_comm, loss-scale window, ...) are accepted and ignored;
any other key is refused in one line naming it. A value of "auto" (Hugging Face Trainer style)
leaves the flag as given on the command line.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.strategies import ParallelSettings

log = logging.getLogger(__name__)

ZERO_STAGES = {0: "ddp", 1: "fsdp-grad-op", 2: "fsdp-grad-op", 3: "fsdp"}
TOP_LEVEL = {"zero_optimization", "fp16", "bf16", "gradient_clipping", "train_micro_batch_size_per_gpu",
             "gradient_accumulation_steps", "train_batch_size"}
IGNORED_TOP_LEVEL = {"steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer"}
ZERO_KEYS = {"stage", "offload_optimizer", "offload_param"}
IGNORED_ZERO_KEYS = {"overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
                     "allgather_partitions", "reduce_scatter", "round_robin_gradients", "sub_group_size",
                     "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                     "stage3_max_live_parameters", "stage3_max_reuse_distance",
                     "stage3_gather_16bit_weights_on_model_save"}
OFFLOAD_KEYS = {"device", "pin_memory"}
PRECISION_KEYS = {"enabled"}
IGNORED_FP16_KEYS = {"loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
                     "auto_cast"}


@dataclass(frozen=True)
class DeepSpeedPlan:
    parallel: ParallelSettings
    """--strategy and --cpu-offload as the config asks."""
    train: dict[str, Any] = field(default_factory=dict)
    """TrainSettings fields the config sets (batch_size, grad_accum, precision, max_grad_norm)."""


def load_deepspeed_config(path: Path, world_size: int) -> DeepSpeedPlan:
    """Read and map a DeepSpeed JSON file; ValueError naming the file and key for anything unsupported."""
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--deepspeed {str(path)!r} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"--deepspeed {str(path)!r} is not a readable JSON file: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--deepspeed {str(path)!r} must hold a JSON object")
    return map_deepspeed_config(config, world_size, where=f"--deepspeed {path}")


def map_deepspeed_config(config: dict[str, Any], world_size: int, where: str = "--deepspeed") -> DeepSpeedPlan:
    _refuse_unknown(config, TOP_LEVEL, IGNORED_TOP_LEVEL, where)
    zero = _section(config, "zero_optimization", where)
    _refuse_unknown(zero, ZERO_KEYS, IGNORED_ZERO_KEYS, f"{where} zero_optimization")
    stage = zero.get("stage", 0)
    if stage not in ZERO_STAGES:
        raise ValueError(f"{where}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    offload = _offload(zero, "offload_optimizer", where) | _offload(zero, "offload_param", where)
    if _offload(zero, "offload_param", where) and stage != 3:
        raise ValueError(f"{where}: offload_param needs zero_optimization.stage 3, got stage {stage}")
    if offload and stage == 0:
        raise ValueError(f"{where}: offload_optimizer needs zero_optimization.stage 1, 2 or 3")
    train: dict[str, Any] = {}
    train.update(_precision(config, where))
    train.update(_batch(config, world_size, where))
    clipping = config.get("gradient_clipping", "auto")
    if clipping != "auto":
        if not isinstance(clipping, (int, float)) or isinstance(clipping, bool) or clipping < 0:
            raise ValueError(f"{where}: gradient_clipping must be a number >= 0, got {clipping!r}")
        train["max_grad_norm"] = float(clipping) if clipping > 0 else math.inf  # DeepSpeed: 0 = no clipping
    plan = DeepSpeedPlan(ParallelSettings(strategy=ZERO_STAGES[stage], cpu_offload=offload), train)
    log.info("%s: ZeRO stage %d -> --strategy %s%s; %s", where, stage, plan.parallel.strategy,
             " --cpu-offload" if offload else "", train or "no training settings")
    return plan


def _refuse_unknown(section: dict[str, Any], known: set[str], ignored: set[str], where: str) -> None:
    unknown = sorted(set(section) - known - ignored)
    if unknown:
        raise ValueError(f"{where}: unsupported key(s) {', '.join(unknown)}; supported: {', '.join(sorted(known))}")


def _section(config: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = config.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {key} must be an object, got {value!r}")
    return value


def _offload(zero: dict[str, Any], key: str, where: str) -> bool:
    section = _section(zero, key, f"{where} zero_optimization")
    _refuse_unknown(section, OFFLOAD_KEYS, set(), f"{where} zero_optimization.{key}")
    device = section.get("device", "none")
    if device not in ("none", "cpu"):
        raise ValueError(f"{where}: zero_optimization.{key}.device {device!r} is not supported; use \"cpu\"")
    return device == "cpu"


def _precision(config: dict[str, Any], where: str) -> dict[str, Any]:
    enabled = {}
    for name in ("fp16", "bf16"):
        section = _section(config, name, where)
        _refuse_unknown(section, PRECISION_KEYS, IGNORED_FP16_KEYS if name == "fp16" else set(), f"{where} {name}")
        flag = section.get("enabled", "auto")  # an absent section leaves --precision alone
        if flag != "auto":
            enabled[name] = bool(flag)
    if enabled.get("fp16") and enabled.get("bf16"):
        raise ValueError(f"{where}: fp16 and bf16 are both enabled; enable one")
    if not enabled:
        return {}
    return {"precision": "fp16" if enabled.get("fp16") else "bf16" if enabled.get("bf16") else "fp32"}


def _batch(config: dict[str, Any], world_size: int, where: str) -> dict[str, Any]:
    micro = config.get("train_micro_batch_size_per_gpu", "auto")
    accum = config.get("gradient_accumulation_steps", "auto")
    total = config.get("train_batch_size", "auto")
    for key, value in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", accum),
                       ("train_batch_size", total)):
        if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{where}: {key} must be a positive integer or \"auto\", got {value!r}")
    out: dict[str, Any] = {}
    if accum != "auto":
        out["grad_accum"] = accum
    if micro != "auto":
        out["batch_size"] = micro * (1 if accum == "auto" else accum) * world_size
    if total != "auto" and "batch_size" in out and total != out["batch_size"]:
        raise ValueError(f"{where}: train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
                         f"gradient_accumulation_steps {accum} x {world_size} rank(s)")
    if total != "auto" and "batch_size" not in out:
        out["batch_size"] = total
    return out
