"""Names the coordinator's flags choose from, importable without torch so ``--help`` is instant.

The registries themselves (``coordinator.aggregation``) import torch; tests/cli checks that these
names are exactly their keys.
"""
from __future__ import annotations

AGGREGATION_NAMES = ("fedasync", "fedbuff")
"""Keys of ``coordinator.aggregation.AGGREGATORS`` (``--aggregation``)."""
ROBUST_NAMES = ("clip", "median", "trimmed_mean")
"""Keys of ``coordinator.aggregation.ROBUST_RULES`` (``--robust``, besides ``none``)."""
