"""Aggregation rules, chosen by name (``--aggregation``)."""
from coordinator.aggregation.base import AggregationParams, Aggregator, StateDict, Update, staleness_weight
from coordinator.aggregation.fedasync import fedasync
from coordinator.aggregation.fedbuff import fedbuff

AGGREGATORS: dict[str, Aggregator] = {"fedasync": fedasync, "fedbuff": fedbuff}

__all__ = ["AGGREGATORS", "AggregationParams", "Aggregator", "StateDict", "Update", "staleness_weight"]
