"""Names the worker's flags choose from, importable without torch (run_worker.py --help stays fast).

The modules that implement them import these tuples, so the two cannot drift.
"""

STRATEGY_CHOICES = ("auto", "ddp", "fsdp", "fsdp-grad-op")
"""--strategy: how a torchrun worker spreads one expert over its processes (worker/strategies.py)."""
