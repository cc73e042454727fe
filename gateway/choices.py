"""Names of the merge strategies, importable without torch so ``--help`` is instant.

The registry itself (``gateway.merges.MERGES``) imports torch; tests/cli checks that these names
are exactly its keys.
"""
from __future__ import annotations

MERGE_NAMES = ("dare", "dare_ties", "task_arithmetic", "ties", "weighted_average")
"""Keys of ``gateway.merges.MERGES`` (``--gateway-strategy``, ``--strategy``), sorted."""
DEFAULT_ROUTE_THRESHOLD = 0.46
"""``gateway.router.DEFAULT_THRESHOLD`` (``--route-threshold``), here without importing numpy."""
