"""The root's registry of relay coordinators (docs/history/wan.md, "Relays"): who registered, their reports, the tree.

The routes that fill it are coordinator/api/relays.py.

A relay (``coordinator.relay``) registers with the relay join token (``<data dir>/relay_join_token``, not
the workers' join token: a worker must not be able to make itself a relay) at ``POST /api/v1/relays`` and
gets a relay-scoped token (``coordinator.access.tokens``, role ``relay``): it may push and pull for any expert, on
behalf of its workers; its resumable uploads are its own (coordinator/api/uploads.py ``owner_of``). Registration refuses (409) a relay whose base model fingerprint differs from
an existing expert's, so a relay for another model never starts. Each forward interval the relay
reports its workers and byte counts at ``POST /api/v1/relays/<id>/report``; ``GET /api/v1/relays``
lists the tree (relays, their workers, bytes saved), which is also how workers discover relays.

Reports are soft state, kept in memory: a restarted root shows a relay again after its next report.
"""
from __future__ import annotations

import threading
import time
from typing import Any

REPORT_COUNTERS = ("bytes_received", "bytes_forwarded", "updates_received", "updates_forwarded",
                   "batches_forwarded", "queued_updates", "queued_bytes", "bytes_served", "bytes_fetched",
                   "diff_bytes_served", "diffs_unavailable", "full_fetches", "diff_fetches")
MAX_REPORTED_WORKERS = 10_000
FRESH_REPORT_SECONDS = 300.0
"""A relay whose last report is older than this no longer counts as a source of an expert's updates (its reports
come every forward interval, 5-30 s)."""


class RelayRegistry:
    """Relays known to this root and their latest reports (in memory)."""

    def __init__(self) -> None:
        self._relays: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def registered(self, relay_id: str, url: str | None, base_model: dict[str, str] | None) -> None:
        with self._lock:
            entry = self._relays.setdefault(relay_id, {"relay_id": relay_id, "workers": [], "stats": {}})
            entry |= {"url": url, "base_model": base_model, "registered_at": time.time(), "last_report": None}

    def report(self, relay_id: str, workers: list[dict[str, Any]], stats: dict[str, int]) -> None:
        with self._lock:
            entry = self._relays.setdefault(relay_id, {"relay_id": relay_id, "url": None, "base_model": None,
                                                       "registered_at": None})
            entry |= {"workers": workers, "stats": stats, "last_report": time.time()}

    def sources_on(self, specialty: str, now: float | None = None) -> int:
        """Relays that forward updates of ``specialty``: a fresh report listing a worker of it that is not gone.

        fedasync's N at the root (coordinator.steps) counts each as one source: a relay's batch is its site's
        mean (FedBuff's, coordinator/relay/forwarder.py), as one direct worker's update is that worker's."""
        now = time.time() if now is None else now
        with self._lock:
            return sum(1 for r in self._relays.values()
                       if r.get("last_report") is not None and now - r["last_report"] <= FRESH_REPORT_SECONDS
                       and any(w.get("specialty") == specialty and w.get("status") != "gone" for w in r["workers"]))

    def tree(self) -> list[dict[str, Any]]:
        with self._lock:
            relays = [dict(r) for r in self._relays.values()]
        for r in relays:
            stats = r.get("stats") or {}
            # pushes: worker bodies taken minus combined updates sent on; pulls: served from cache minus fetched
            r["bytes_saved"] = max(0, stats.get("bytes_received", 0) - stats.get("bytes_forwarded", 0)) + \
                max(0, stats.get("bytes_served", 0) - stats.get("bytes_fetched", 0))
        return sorted(relays, key=lambda r: r["relay_id"])
