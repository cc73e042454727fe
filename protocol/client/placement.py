"""A client's placement calls: the root's relays, its plan of who syncs where, and a worker's link report."""
from __future__ import annotations

from typing import Any

from protocol.client.transport import Transport


class Placement:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def relays(self) -> list[dict[str, Any]]:
        """The root's relays (GET /api/v1/relays): their URLs, workers and bytes saved."""
        return self.transport.json("GET", "/relays")["relays"]

    def plan(self) -> dict[str, Any]:
        """The root's plan (``GET /api/v1/placement``): its groups, each with the relay its members sync with."""
        return self.transport.json("GET", "/placement")

    def report_probes(self, worker_id: str, links: dict[str, dict[str, float | None]]) -> dict[str, Any]:
        """Send this worker's link measurements to the root (``POST /api/v1/workers/<id>/probes``): host id
        ("root" or a relay id) -> {"rtt_ms", "mbps"} (None: unreachable). The answer is the worker's placement."""
        return self.transport.json("POST", f"/workers/{worker_id}/probes", worker=worker_id, json={"links": links})
