"""Names the worker's flags choose from, and the rules between flags, importable without torch (run_worker.py
--help and a mistyped flag answer before torch loads).

The modules that implement them import these, so the two cannot drift.
"""
import math

STRATEGY_CHOICES = ("auto", "ddp", "fsdp", "fsdp-grad-op")
"""--strategy: how a torchrun worker spreads one expert over its processes (worker/strategies.py)."""

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
