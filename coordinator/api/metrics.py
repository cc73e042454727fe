"""Prometheus metrics at GET /metrics (standard client library, one registry per app).

Counters move in an ``after_request`` hook keyed by the Flask endpoint, so the API
code stays free of metrics calls; expert versions and worker liveness are read from
the store when Prometheus scrapes.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from flask import Flask, Response, g, request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from coordinator.service import Coordinator

UPDATE_OUTCOMES = {202: "accepted", 200: "duplicate"}


class _StateCollector(Collector):
    """Gauges computed at scrape time from the manifest."""

    def __init__(self, coordinator: "Coordinator") -> None:
        self._c = coordinator

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        versions = GaugeMetricFamily("fedmoe_expert_version", "Current version of each expert", labels=["expert"])
        samples = GaugeMetricFamily("fedmoe_expert_samples", "Training samples behind each expert", labels=["expert"])
        for e in self._c.store.rows.experts():
            versions.add_metric([e.name], e.version)
            samples.add_metric([e.name], e.samples_seen)
        workers = GaugeMetricFamily("fedmoe_workers", "Workers by liveness", labels=["status"])
        counts = {"alive": 0, "stale": 0, "gone": 0}
        for w in self._c.list_workers():
            counts[w["status"]] += 1
        for status, n in counts.items():
            workers.add_metric([status], n)
        group = self._c.store.group_commit  # syncs / flushes: writes that shared each flush to disk
        syncs = CounterMetricFamily("fedmoe_store_syncs", "Writes that waited to be durable (group commit)",
                                    value=group.syncs)
        flushes = CounterMetricFamily("fedmoe_store_flushes", "Flushes to disk (WAL and blob directory fsyncs) "
                                      "that made them durable", value=group.flushes)
        yield from (versions, samples, workers, syncs, flushes)


class CoordinatorMetrics:
    def __init__(self, coordinator: "Coordinator") -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("fedmoe_http_requests", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=self.registry)
        self.update_bytes = Counter("fedmoe_update_bytes", "Body bytes of pushed updates (in) and pulled weights (out)",
                                    ["expert", "direction"], registry=self.registry)
        self.updates = Counter("fedmoe_updates", "Pushed updates by outcome (accepted, duplicate, rejected)",
                               ["expert", "outcome"], registry=self.registry)
        self.routes = Counter("fedmoe_routes", "Prompts routed by /api/v1/route, by the expert the caller expected "
                              "('' when none) and outcome: right, wrong_expert, fallback (to the gateway); without an "
                              "expected expert: expert, fallback", ["expected", "outcome"], registry=self.registry)
        self.aggregation = Histogram("fedmoe_aggregation_seconds", "Time to apply one aggregation step",
                                     registry=self.registry)
        self.registry.register(_StateCollector(coordinator))

    def install(self, app: Flask) -> None:
        app.after_request(self._count)
        app.add_url_rule("/metrics", "metrics", self._expose)

    def _count(self, response: Response) -> Response:
        rule = request.url_rule.rule if request.url_rule else "unmatched"
        self.requests.labels(rule, request.method, str(response.status_code)).inc()
        expert = (request.view_args or {}).get("name")
        if request.endpoint in ("api.push_update", "uploads.complete_upload") and expert:  # one-shot, resumable
            outcome = UPDATE_OUTCOMES.get(response.status_code, "rejected")
            self.updates.labels(expert, outcome).inc()
            if outcome == "accepted" and request.endpoint == "api.push_update":
                self.update_bytes.labels(expert, "in").inc(request.content_length or 0)
        elif request.endpoint == "uploads.upload_chunk" and expert and response.status_code == 200:
            self.update_bytes.labels(expert, "in").inc(request.content_length or 0)  # a resumable push's chunk
        elif request.endpoint == "api.route" and response.status_code == 200 and "route_outcome" in g:
            self.routes.labels(*g.route_outcome).inc()
        elif request.endpoint == "api.expert_weights" and expert and response.status_code == 200:
            self.update_bytes.labels(expert, "out").inc(response.content_length or 0)
        return response

    def _expose(self) -> Response:
        return Response(generate_latest(self.registry), mimetype=CONTENT_TYPE_LATEST)
