"""A hierarchy that forms itself: where each worker should sync, from the links workers measure (docs/wan.md).

Workers report their probes (``protocol.probe``: RTT and download throughput) to the root: to the root itself and to
every relay the root knows, operator-started ones and those embedded in workers started with ``--can-relay``
(a worker's own relay is a relay like any other: ``run_coordinator.py --upstream`` registered at the root). The root
turns the reports into a plan:

1. **Distances between workers.** Workers do not serve anything, so two workers are compared through the hosts they
   both measured: ``d(a, b) = min over measured hosts h of rtt(a, h) + rtt(b, h)`` (the shortest two-hop path, an
   upper bound of their distance; a relay embedded in b's own process makes it ``rtt(a, b's relay)``). Workers of one
   site meet at their site's relays (1-2 ms), workers of two sites only at the root or across the WAN (100+ ms).
2. **Groups.** The spectral clustering of ``coordinator.grouping`` on that matrix, k chosen by the largest eigengap.
3. **A relay per group.** Among the relays the group's members measured, the one with the least total RTT to them
   (unreachable counts as infinite), if that total beats the root's: a group whose members are as close to the root as
   to any relay, or that has one member, syncs with the root (a relay for one worker saves nothing upstream).
4. **Hysteresis.** ``Placement.consider`` adopts a new plan at once when the workers or relays changed (one joined,
   left or stopped answering, or a worker first reached a relay: it came up after the worker's last report), else only when it moves some worker to a host whose estimated sync is at least
   ``improvement`` (30%) faster than its current host's and the last change is ``hold_seconds`` (60 s) old: RTTs measured on
   a loaded link jitter by tens of percent, and each move costs the worker a registration at its new coordinator.

A worker follows its assignment under the client's fail-over rules (``CoordinatorClient.move_to``: the assigned
coordinator first, the root after it), so a relay that dies sends its workers back to the root until the next plan,
and a retried push keeps its update id: exactly once across the move (``coordinator/relay/relay_store.py``'s members).
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.grouping import propose_groups

ROOT = "root"
"""The host id of the root in reports and plans."""
SYNC_BYTES = 10 << 20
"""Bytes one sync moves, for comparing hosts (a smollm2-135m rank-8 adapter is 9.8 MB each way)."""
ROUND_TRIPS = 6


@dataclass(frozen=True)
class Link:
    """One worker's measurement of one host."""

    rtt_ms: float
    """Median round trip (inf: unreachable)."""
    mbps: float = 0.0
    """Download throughput, megabits per second (0: not measured)."""

    @property
    def reachable(self) -> bool:
        return math.isfinite(self.rtt_ms)

    def sync_seconds(self, nbytes: int = SYNC_BYTES) -> float:
        """Estimated seconds of one sync (protocol.probe's model): round trips plus the bytes at the rate."""
        if not self.reachable:
            return math.inf
        transfer = nbytes * 8 / (self.mbps * 1e6) if self.mbps > 0 else 0.0
        return ROUND_TRIPS * self.rtt_ms / 1000 + transfer


Reports = Mapping[str, Mapping[str, Link]]
"""worker id -> host id (ROOT or a relay id) -> the worker's measurement of it."""


@dataclass(frozen=True)
class Group:
    members: tuple[str, ...]
    relay: str | None
    """The relay id its members sync with (None: the root)."""


@dataclass(frozen=True)
class Plan:
    groups: tuple[Group, ...]
    hosts: tuple[str, ...]
    """The relays that were candidates (registered and measured) when the plan was made."""

    def host_of(self, worker: str) -> str | None:
        """The relay id ``worker`` syncs with (None: the root, also for a worker the plan does not know)."""
        return next((g.relay for g in self.groups if worker in g.members), None)

    @property
    def workers(self) -> frozenset[str]:
        return frozenset(w for g in self.groups for w in g.members)

    def to_json(self) -> list[dict[str, Any]]:
        return [{"members": list(g.members), "relay_id": g.relay} for g in self.groups]


def distances(reports: Reports, workers: Sequence[str]) -> np.ndarray:
    """Milliseconds between each pair of workers: the shortest path through a host both measured."""
    n = len(workers)
    d = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            a, b = reports[workers[i]], reports[workers[j]]
            paths = [a[h].rtt_ms + b[h].rtt_ms for h in a.keys() & b.keys()]
            d[i, j] = d[j, i] = min(paths, default=math.inf)
    finite = d[np.isfinite(d)]
    d[~np.isfinite(d)] = 10 * max(float(finite.max()) if finite.size else 1.0, 1.0)  # far apart, yet a matrix
    return d


def choose_relay(members: Sequence[str], reports: Reports, relays: Sequence[str]) -> str | None:
    """The relay with the least total estimated sync time for ``members``, if it beats the root's; else None."""
    if len(members) < 2:
        return None

    def total(host: str) -> float:
        return sum(reports[m].get(host, Link(math.inf)).sync_seconds() for m in members)

    best = min(relays, key=lambda r: (total(r), r), default=None)
    if best is None or not math.isfinite(total(best)) or total(best) >= total(ROOT):
        return None
    return best


def plan(reports: Reports, relays: Sequence[str], groups: int | None = None) -> Plan:
    """Groups of the reporting workers and each group's relay (deterministic: the same reports, the same plan)."""
    workers = sorted(reports)
    hosts = tuple(sorted(relays))
    if not workers:
        return Plan((), hosts)
    found = propose_groups(distances(reports, workers), groups)
    out = [Group(tuple(workers[i] for i in g.members), None) for g in found]
    return Plan(tuple(Group(g.members, choose_relay(g.members, reports, hosts)) for g in out), hosts)


def cost(p: Plan, reports: Reports) -> dict[str, float]:
    """Each worker's estimated sync seconds at the host ``p`` gives it."""
    return {w: reports[w].get(p.host_of(w) or ROOT, Link(math.inf)).sync_seconds() for w in reports}


@dataclass
class Placement:
    """The plan in force, and the reports it is made from (in memory: soft state, like the relays' reports;
    a restarted root plans again from the next reports, and its workers stay where they are until then)."""

    improvement: float = 0.3
    """A plan that changes nothing in the membership is adopted only if it speeds some worker's sync by this share."""
    hold_seconds: float = 60.0
    """... and the plan in force is at least this old."""
    expire_seconds: float = 150.0
    """A worker that has not reported for this long has left (workers report every --placement-interval, 30 s)."""
    clock: Callable[[], float] = time.monotonic
    reports: dict[str, dict[str, Link]] = field(default_factory=dict)
    reported_at: dict[str, float] = field(default_factory=dict)
    current: Plan = field(default_factory=lambda: Plan((), ()))
    generation: int = 0
    """Counts adopted plans (a worker that sees it change asks where to go)."""
    changed_at: float = -math.inf
    _reachable: frozenset[tuple[str, str]] = field(default_factory=frozenset, repr=False)
    """(worker, host) pairs measured reachable at the last consideration: a new one is news, not jitter."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def report(self, worker: str, links: Mapping[str, Link], relays: Sequence[str]) -> bool:
        """A worker's fresh measurements; True if the plan changed."""
        with self._lock:
            self.reports[worker], self.reported_at[worker] = dict(links), self.clock()
            for gone in [w for w, at in self.reported_at.items() if self.clock() - at > self.expire_seconds]:
                del self.reports[gone], self.reported_at[gone]
            return self._consider(relays)

    def forget(self, workers: Sequence[str], relays: Sequence[str]) -> bool:
        """Workers that left (no heartbeat); True if the plan changed."""
        with self._lock:
            gone = [w for w in workers if self.reports.pop(w, None) is not None]
            for w in gone:
                del self.reported_at[w]
            return self._consider(relays) if gone else False

    def _consider(self, relays: Sequence[str]) -> bool:
        live = [r for r in relays if any(r in links for links in self.reports.values())]
        proposal = plan(self.reports, live)
        reachable = frozenset((w, h) for w, links in self.reports.items() for h, link in links.items() if link.reachable)
        # a worker that reaches a host it could not reach before (a relay that came up after its last report) is a
        # change of the topology like a join: it must not wait out the hold meant for jittery RTTs
        new_links, self._reachable = bool(reachable - self._reachable), reachable
        if proposal.groups == self.current.groups:
            return False
        membership_changed = (proposal.workers != self.current.workers or proposal.hosts != self.current.hosts
                              or new_links)
        if not membership_changed and not self._worth_moving(proposal):
            return False
        self.current, self.changed_at = proposal, self.clock()
        self.generation += 1
        return True

    def _worth_moving(self, proposal: Plan) -> bool:
        if self.clock() - self.changed_at < self.hold_seconds:
            return False
        now, then = cost(self.current, self.reports), cost(proposal, self.reports)
        return any(then[w] < (1 - self.improvement) * now[w] for w in then)

    def assignment(self, worker: str) -> dict[str, Any]:
        with self._lock:
            return {"worker_id": worker, "relay_id": self.current.host_of(worker), "generation": self.generation,
                    "planned": worker in self.current.workers}

    def view(self) -> dict[str, Any]:
        with self._lock:
            return {"generation": self.generation, "groups": self.current.to_json(),
                    "changed_seconds_ago": None if not math.isfinite(self.changed_at)
                    else round(self.clock() - self.changed_at, 1)}
