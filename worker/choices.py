"""Names the worker's flags choose from, importable without torch (run_worker.py --help stays fast).

The modules that implement them import these tuples, so the two cannot drift.
"""

STRATEGY_CHOICES = ("auto", "ddp", "fsdp", "fsdp-grad-op")
"""--strategy: how a torchrun worker spreads one expert over its processes (worker/strategies.py)."""

DATASET_FORMATS = ("auto", "messages", "sharegpt", "alpaca", "prompt-reference", "prompt-completion", "text")
"""--dataset-format: how the rows of --dataset are laid out (worker/datasets/), detected with auto."""

OPTIMIZERS = ("adamw", "galore")
"""--optimizer: AdamW, or GaLore's low-rank projected Adam for full-parameter experts (worker/galore.py)."""
