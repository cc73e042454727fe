"""Measure the link to coordinators (root or relays) and pick the best one (docs/wan.md, "A hierarchy that forms itself").

A probe is a few small round trips to ``GET /api/v1/health`` on one kept-alive connection (the
median is the RTT) and one download of ``GET /api/v1/probe?bytes=N`` (public, zero bytes, at most
``MAX_PROBE_BYTES``) for throughput. Coordinators are ranked by the time one sync would take:
``round_trips * rtt + sync_bytes / throughput``, so a near, slow relay can lose to a far, fast root
when updates are large, and win when they are small.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import requests

log = logging.getLogger(__name__)

MAX_PROBE_BYTES = 4 << 20
PROBE_PATH = "/api/v1/probe"


@dataclass(frozen=True)
class LinkEstimate:
    url: str
    rtt: float
    """Median round trip of a small request, seconds (inf when unreachable)."""
    throughput: float
    """Download bytes per second (0 when unreachable)."""
    error: str | None = None

    @property
    def reachable(self) -> bool:
        return self.error is None

    def sync_seconds(self, sync_bytes: int, round_trips: int = 6) -> float:
        """Estimated seconds of one sync moving ``sync_bytes`` in ``round_trips`` requests."""
        if not self.reachable or self.throughput <= 0:
            return float("inf")
        return round_trips * self.rtt + sync_bytes / self.throughput


def probe(url: str, pings: int = 3, download_bytes: int = 256 << 10, timeout: float = 5.0,
          clock: Callable[[], float] = time.perf_counter) -> LinkEstimate:
    """Measure ``url`` (a coordinator's base URL); an unreachable one gives an estimate with ``error``."""
    url = url.rstrip("/")
    with requests.Session() as session:
        session.trust_env = False
        try:
            rtts = []
            for _ in range(pings + 1):  # the first one also opens the connection: not counted
                started = clock()
                session.get(f"{url}/api/v1/health", timeout=timeout).raise_for_status()
                rtts.append(clock() - started)
            started = clock()
            r = session.get(f"{url}{PROBE_PATH}", params={"bytes": download_bytes}, timeout=timeout)
            r.raise_for_status()
            elapsed = max(clock() - started - statistics.median(rtts[1:]), 1e-6)  # minus the request's own RTT
            return LinkEstimate(url, statistics.median(rtts[1:]), len(r.content) / elapsed)
        except requests.RequestException as exc:
            return LinkEstimate(url, float("inf"), 0.0, error=type(exc).__name__)


def rank(estimates: Sequence[LinkEstimate], sync_bytes: int = 1 << 20) -> list[LinkEstimate]:
    """Best first: reachable ones by estimated sync time (ties in the given order), unreachable ones last."""
    order = sorted(range(len(estimates)), key=lambda i: (estimates[i].sync_seconds(sync_bytes), i))
    return [estimates[i] for i in order]


def choose(urls: Sequence[str], sync_bytes: int = 1 << 20, prober: Callable[[str], LinkEstimate] = probe
           ) -> list[LinkEstimate]:
    """Probe every URL and rank them; the first is the one to join (unreachable ones last)."""
    ranked = rank([prober(u) for u in urls], sync_bytes)
    log.info("coordinator links: %s", ", ".join(
        f"{e.url} {'unreachable' if not e.reachable else f'rtt {e.rtt * 1000:.1f} ms, {e.throughput / 1e6:.1f} MB/s'}"
        for e in ranked))
    return ranked


def split_urls(text: str) -> list[str]:
    """``--coordinator-url a,b,c`` into its URLs (no empties, order kept, duplicates dropped)."""
    urls: list[str] = []
    for part in (p.strip().rstrip("/") for p in text.split(",")):
        if part and part not in urls:
            urls.append(part)
    return urls
