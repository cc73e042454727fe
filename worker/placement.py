"""--follow-placement: measure the links to the root and its relays, report them, sync where the root says.

Every ``interval`` seconds (and at join) the worker probes the root and every relay the root lists
(``protocol.probe``: RTT and download throughput; a relay it cannot reach is reported unreachable), posts the
measurements to the root (``POST /api/v1/workers/<id>/probes``), and reads its assignment back from the answer: a
relay id, or none (the root). It then moves its coordinator client there with the root as the fail-over
(``CoordinatorClient.move_to``), so a relay that dies sends it back to the root at once and the next plan decides
again. The root groups workers and picks the relays (coordinator/placement.py); nothing here decides a group.

The reports and the assignment always go to the root, through a client of their own (``root``): the worker's
sync client may be at a relay, and a relay does not plan.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.client import CoordinatorClient
from protocol.errors import FedMoEError
from protocol.probe import LinkEstimate, probe

log = logging.getLogger(__name__)
ROOT = "root"


def measured(estimate: LinkEstimate) -> dict[str, float | None]:
    """A probe as the root takes it: milliseconds and megabits per second (None: unreachable)."""
    if not estimate.reachable or not math.isfinite(estimate.rtt):
        return {"rtt_ms": None, "mbps": None}
    return {"rtt_ms": round(estimate.rtt * 1000, 3), "mbps": round(estimate.throughput * 8 / 1e6, 3)}


@dataclass
class PlacementFollower:
    root: CoordinatorClient
    """A client of the root (``--coordinator-url``), registered as this worker there."""
    client: CoordinatorClient
    """The worker's sync client, moved to the assigned coordinator."""
    worker_id: str
    interval: float = 30.0
    """Seconds between two rounds of probes and reports."""
    prober: Callable[[str], LinkEstimate] = probe
    clock: Callable[[], float] = time.monotonic
    relay_id: str | None = None
    """Where the worker syncs now (None: the root)."""
    _last: float = field(default=-math.inf, repr=False)

    def due(self) -> bool:
        return self.clock() - self._last >= self.interval

    def follow(self) -> dict[str, Any] | None:
        """Probe, report, move if the root says so; what happened (None when the root cannot plan: it is then
        asked again only after ``interval``). Failures are logged, never raised: syncing goes on where it is."""
        self._last = self.clock()
        try:
            relays = {r["relay_id"]: r["url"] for r in self.root.placement.relays() if r.get("url")}
            links = {ROOT: measured(self.prober(self.root.base_url))}
            links |= {relay: measured(self.prober(url)) for relay, url in sorted(relays.items())}
            answer = self.root.placement.report_probes(self.worker_id, links)
        except FedMoEError as exc:
            log.info("placement: no plan from the root (%s); syncing with %s", exc, self.client.base_url)
            return None
        assigned = answer.get("relay_id")
        target = relays.get(assigned) if assigned else self.root.base_url
        if target is None:  # a relay the root knows but did not list to us: stay
            return {"relay_id": self.relay_id, "moved": False, "links": links}
        moved = self.client.move_to([target, self.root.base_url] if assigned else [target])
        if moved:
            log.info("placement: syncing with %s now (%s, plan %s)", target, assigned or "the root",
                     answer.get("generation"))
        self.relay_id = assigned
        return {"relay_id": assigned, "moved": moved, "generation": answer.get("generation"), "links": links}
