"""Names the worker's flags choose from, and the rules between flags, importable without torch (run_worker.py
--help and a mistyped flag answer before torch loads).

The modules that implement them import these, so the two cannot drift.
"""
import math

STRATEGY_CHOICES = ("auto", "ddp", "fsdp", "fsdp-grad-op")
"""--strategy: how a torchrun worker spreads one expert over its processes (worker/strategies.py)."""

DEFAULT_CODEC = "int8"
"""--compression's default: blockwise int8 (64 values share a float32 scale, ~3.8x smaller than float32) with
error feedback. On smollm2-135m the coarser int8 of the quality suite (256 values per float16 scale) changed
the held-out loss by -0.00% (docs/benchmarks.md); smaller blocks round off less. The design card has workers
push quantized updates; --compression safetensors is the lossless choice."""
DEFAULT_PULL_CODEC = "int8"
"""--pull-compression's default: a worker holding a version the coordinator still keeps pulls the int8
difference to the latest; every --full-pull-every-th pull, and a pull from a version no longer kept, is full."""
FULL_PULL = "full"
"""--pull-compression full: always the full weights."""


def default_pull_codec(push_codec: str) -> str | None:
    """The pull codec that goes with a push codec when none is named: int8 diffs, or None (full weights) under
    --compression auto, which then picks full weights or a diff at each sync from the measured download rate."""
    return None if push_codec == "auto" else DEFAULT_PULL_CODEC


DATASET_FORMATS = ("auto", "messages", "sharegpt", "alpaca", "prompt-reference", "prompt-completion", "text")
"""--dataset-format: how the rows of --dataset are laid out (worker/datasets/), detected with auto."""

OPTIMIZERS = ("adamw", "galore")
"""--optimizer: AdamW, or GaLore's low-rank projected Adam for full-parameter experts (worker/galore.py)."""

AUTO_CODEC = "auto"
"""--compression auto: the codec and ratio are picked at each sync to fit --sync-budget (worker.adaptive)."""


def check_sync_budget(codec: str, sync_budget: float | None) -> None:
    """--sync-budget goes with --compression auto, and only with it; ValueError naming the flags otherwise."""
    if codec == AUTO_CODEC and sync_budget is None:
        raise ValueError("--compression auto needs --sync-budget SECONDS (how long a push may take)")
    if codec != AUTO_CODEC and sync_budget is not None:
        raise ValueError(f"--sync-budget applies to --compression auto only, got --compression {codec}; "
                         "pass --compression auto or drop --sync-budget")
    if sync_budget is not None and not (sync_budget > 0 and math.isfinite(sync_budget)):
        raise ValueError(f"--sync-budget must be a positive number of seconds, got {sync_budget}")
