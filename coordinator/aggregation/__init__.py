"""Aggregation rules, chosen by name (``--aggregation``; ``--robust`` for buffered rounds)."""
from coordinator.aggregation.base import AggregationParams, Aggregator, StateDict, Update, staleness_weight
from coordinator.aggregation.fedasync import fedasync
from coordinator.aggregation.fedbuff import fedbuff
from coordinator.aggregation.robust import ROBUST_RULES, RobustParams, l2_norm, robust_aggregator

AGGREGATORS: dict[str, Aggregator] = {"fedasync": fedasync, "fedbuff": fedbuff}

__all__ = ["AGGREGATORS", "ROBUST_RULES", "AggregationParams", "Aggregator", "RobustParams", "StateDict", "Update",
           "l2_norm", "robust_aggregator", "staleness_weight"]
