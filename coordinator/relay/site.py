"""The site model: a relay that serves its workers the root's weights plus its site's progress not yet in them.

Without it a relay is a pass-through for weights: its workers train on the root's newest version and only see
each other's steps once the relay has forwarded them and a new root version has come back over the WAN
(~7-10 s in bench.wan). What they push in the meantime are steps from the same weights, which the relay
averages into one step's worth (FedBuff's mean): however many workers a site has, the root moves by about one
averaged step per forwarded batch (docs/history/wan.md, "What bounds the time to target").

With ``--site-model`` the relay keeps the edge model of hierarchical federated learning (HierFAVG: Liu et al.,
"Client-Edge-Cloud Hierarchical Federated Learning", ICC 2020; its clients train on the edge server's model, and
the edge's model is reset to the cloud's after each cloud round):

    site = R + owed

R is the root version the relay holds (its cache), ``owed`` the site's updates not yet in R: each worker update is
added as it arrives (FedAsync inside the site, whose delays are a LAN's), so a worker's next pull already holds its
own and its neighbours' steps. Its weight is the root's default rule (coordinator/aggregation/fedasync.py) for the
N workers of the expert at this site (registered here, not gone): ``s(tau) / N`` with
``s(tau) = 1 / (1 + decay * max(0, tau - (N - 1)))`` and tau the site updates added since that worker last pulled.
N workers training from the same site weights thus move it by their mean, FedAvg's step; at full weight their N
updates added up to an N-times step, and in bench.wan the relay runs' held-out loss rose late (best 0.778, final
0.866 at one site of 3 workers, where every flat run ended near its best).

A forwarded batch is then the *sum* of its members' weighted deltas, the site's
progress since the last batch (with a lossy forward codec plus error feedback, what the root decodes, E_b; the
codec's residual stays owed). When the relay takes a new root version R' that includes batch b (the root's
``applied_version``), ``owed`` drops E_b: the root decided how much of the site's progress to keep (averaged with
the other sites' by FedBuff, discounted by staleness), and the site continues from that, HierFAVG's reset.

The site's weights are served under the root's version number (a worker's ``base_version`` is never ahead of
the root's, so one that fails over to the root pushes there as usual) and an ETag of their own bytes; diff pulls
are not served (a 404: the worker pulls the full weights, over the site's LAN). Exactly-once is untouched: what
is forwarded is built from the durable queue (each update's weight is recorded with it), and the site model is
only what the workers train on, rebuilt from the queue, the pending batches and the residual after a restart.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from coordinator.checks.adapters import non_finite_tensor
from coordinator.aggregation.base import add_deltas, staleness_weight, weighted_sum
from coordinator.storage.blobs import BlobStore
from coordinator.relay.checks import RelayChecks
from coordinator.checks.update_limits import headroom
from coordinator.liveness import workers_on_expert
from coordinator.relay.relay_store import RelayStore, held_deltas
from coordinator.relay.relay_store_schema import CachedWeights
from protocol.errors import FedMoEError
from protocol.streaming import read_header
from protocol.tensors import StateDict, dumps, load_file, loads

log = logging.getLogger(__name__)

SITE_WEIGHT = "site_weight"
"""Key of a worker update's weight in the site model, in the meta the relay records with it."""


@dataclass
class _Pending:
    update_id: str
    delta: StateDict
    """What the root decodes of the batch (E_b)."""
    applied_version: int | None = None


@dataclass
class _Site:
    root: CachedWeights
    owed: StateDict
    counter: int = 0
    """Changes of the site's weights so far (a worker's staleness inside the site is counted in them)."""
    served: dict[str, int] = field(default_factory=dict)
    """Each worker's counter when it last pulled."""
    pending: list[_Pending] = field(default_factory=list)
    """Batches forwarded whose inclusion in the held root version is not known yet."""
    entry: CachedWeights | None = None
    body: bytes = b""
    """The site's weights as served (safetensors bytes of R + owed)."""
    base: StateDict | None = None
    """R's tensors, read once per root version."""
    base_room: float | None = None
    """Their ``coordinator.checks.update_limits.headroom``, for ``admit``'s check."""
    dirty: bool = True
    """Updates added since ``body`` was built: rebuilt on the next pull (several pushes, one rebuild)."""


class SiteModel:
    def __init__(self, store: RelayStore, blobs: BlobStore, root_weights: Callable[[str], CachedWeights],
                 applied_version: Callable[[str], int | None], staleness_decay: float,
                 alpha: float | None = None) -> None:
        self.store, self.blobs = store, blobs
        self.root_weights = root_weights
        self.applied_version = applied_version
        """The root's applied_version of a forwarded batch (None: not applied yet, e.g. buffered)."""
        self.staleness_decay = staleness_decay
        self.alpha = alpha
        """The relay's --async-alpha: None (auto) is 1 / N with grace N - 1, as at a root; a number is that weight
        with grace 0 (1: the original rule, each update whole)."""
        self._sites: dict[str, _Site] = {}
        self.lock = threading.RLock()
        """Held by the relay while it records a worker update and adds it here: a site built from the queue
        meanwhile would count it twice."""

    # what the relay's service calls ------------------------------------------------

    def weights(self, name: str, worker_id: str | None) -> tuple[CachedWeights, bytes]:
        """The site's weights for a pull (entry and bytes); the root's newer version taken in first."""
        root = self.root_weights(name)
        with self.lock:
            site = self._sites.get(name)
            unknown = [] if site is None or root.version == site.root.version else \
                [p for p in site.pending if p.applied_version is None]
        self._ask_upstream(unknown)  # not under the lock: pushes are recorded meanwhile
        with self.lock:
            site = self._site(name, root)
            if root.version != site.root.version or root.etag != site.root.etag:
                self._rebase(site, root)
            if site.dirty:
                self._publish(name, site)
            if worker_id is not None:
                site.served[worker_id] = site.counter
            assert site.entry is not None
            return site.entry, site.body

    def weight_for(self, name: str, worker_id: str | None) -> float:
        """The weight of this worker's update in the site model: s(site changes since its last pull) / N, with
        grace N - 1, for the N workers of ``name`` registered at this relay and not gone (at least 1); with a fixed
        ``alpha``, alpha x s(changes) with grace 0."""
        n = 1 if self.alpha is not None else max(1, workers_on_expert(self.store.workers(), name))
        with self.lock:
            site = self._sites.get(name)
            staleness = 0 if site is None or worker_id is None else \
                max(0, site.counter - site.served.get(worker_id, site.counter))
        alpha = self.alpha if self.alpha is not None else 1.0 / n
        return alpha * staleness_weight(staleness, self.staleness_decay, grace=n - 1)

    def admit(self, name: str, root: CachedWeights, delta: Mapping[str, torch.Tensor], weight: float,
              checks: RelayChecks, update_id: str) -> StateDict:
        """What the site owes with this worker update added (weighted ``weight``), for ``added`` once it is recorded;
        InvalidUpdate (422) if the site's weights, or a root step taking in what it owes, would not be finite.

        Checked on the root version the site stands on (what ``owed`` is relative to; ``root``, the relay's newest,
        only for a site not built yet or whose version left the relay's disk): the newest may already hold batches
        the site still owes, and counting them twice refused honest updates once the weights were large. The sum
        of the site's updates is what overflows, where the forwarder's mean of them could not
        (coordinator/relay/checks.py). The caller holds ``lock`` until ``added``."""
        with self.lock:
            site = self._site(name, root)
            try:
                base = self._base(site)
            except FileNotFoundError:  # pruned from the relay's history: take the newest now, as a pull would
                self._rebase(site, root)
                base = self._base(site)
            if site.base_room is None:
                site.base_room = headroom(base)
            owed = {k: v.clone() for k, v in site.owed.items()}
            add_deltas(owed, [(delta, weight)])
            checks.check_site(base, site.base_room, owed, update_id, name)
            return owed

    def added(self, name: str, owed: StateDict) -> None:
        """A worker update was recorded durably: the site owes ``owed`` (from ``admit``) from now on."""
        with self.lock:
            site = self._sites.get(name)
            if site is None:  # reset meanwhile (a refused or superseded batch): rebuilt from the queue on a pull
                return
            site.owed = owed
            site.counter += 1
            site.dirty = True

    def forwarded(self, name: str, update_id: str, delta: StateDict, applied_version: int | None) -> None:
        """Batch ``update_id`` reached the root, which decodes ``delta`` of it."""
        with self.lock:
            site = self._sites.get(name)
            if site is None:
                return
            if applied_version is not None and applied_version <= site.root.version:  # already taken in
                add_deltas(site.owed, [(delta, -1.0)])
                site.counter += 1
                site.dirty = True
            else:
                site.pending.append(_Pending(update_id, delta, applied_version))

    def reset(self, name: str) -> None:
        """Rebuilt from the durable state on the next pull (a batch was superseded: its members are queued again)."""
        with self.lock:
            self._sites.pop(name, None)

    # inside ----------------------------------------------------------------------

    def _site(self, name: str, root: CachedWeights) -> _Site:
        site = self._sites.get(name)
        if site is None:
            site = self._sites[name] = _Site(root, self._owed_from_store(name, root))
        return site

    def _owed_from_store(self, name: str, root: CachedWeights) -> StateDict:
        """After a (re)start: the forward codec's residual, batches built but not sent, and the queued updates."""
        manifest = read_header(self.blobs.path(root.blob)).manifest
        weighted: list[tuple[Mapping[str, torch.Tensor], float]] = []
        residual = self.store.residual(name)
        if residual is not None:
            weighted.append((loads(self.blobs.path(residual).read_bytes()), 1.0))
        batch = self.store.pending_batch(name)
        if batch is not None:
            weighted.append((held_deltas(self.blobs, batch, manifest), 1.0))
        weighted += [(held_deltas(self.blobs, u, manifest), float(u.meta.get(SITE_WEIGHT, 1.0)))
                     for u in self.store.queued(name)]
        return weighted_sum(manifest, weighted)

    def _ask_upstream(self, pending: list[_Pending]) -> None:
        """Which root version applied each of these batches (a FedBuff root answers a push before it applies it)."""
        for p in pending:
            try:
                p.applied_version = self.applied_version(p.update_id)
            except FedMoEError as exc:  # upstream unreachable: ask again at the next version
                log.warning("could not ask upstream about batch %s: %s", p.update_id, exc)

    def _rebase(self, site: _Site, root: CachedWeights) -> None:
        """Take root version ``root``: batches it includes are no longer owed (HierFAVG's reset to the cloud)."""
        still = []
        for p in site.pending:
            if p.applied_version is not None and p.applied_version <= root.version:
                add_deltas(site.owed, [(p.delta, -1.0)])
            else:
                still.append(p)
        site.pending, site.root, site.base, site.base_room = still, root, None, None
        site.counter += 1
        site.dirty = True

    def _base(self, site: _Site) -> StateDict:
        """The tensors of the root version the site stands on, read once per version (FileNotFoundError once the
        relay's cache has let it go)."""
        if site.base is None:
            site.base = load_file(self.blobs.path(site.root.blob))
        return site.base

    def _publish(self, name: str, site: _Site) -> None:
        """Build the served bytes of R + owed (kept in memory: rebuilt at most once per pull, ~45 ms for 9.8 MB)."""
        base = self._base(site)
        weights = {k: v + site.owed[k].to(v.dtype) for k, v in base.items()}
        bad = non_finite_tensor(weights)
        if bad is not None:  # a new root version the site's updates were not checked against: never serve Inf
            log.error("the site's weights of %s overflow tensor %r on root version %d: serving the root's own until "
                      "its next version", name, bad, site.root.version)
            weights = base
        site.body = dumps(weights)
        site.entry = CachedWeights(name, site.root.version, hashlib.sha256(site.body).hexdigest(), site.root.blob,
                                   site.root.info)
        site.dirty = False


def sum_weighted(updates: list[tuple[dict[str, Any], Mapping[str, torch.Tensor]]],
                 manifest: list[tuple[str, tuple[int, ...]]]) -> StateDict:
    """A site batch: the sum of its members' deltas, each with the weight it had in the site model."""
    return weighted_sum(manifest, [(delta, float(meta.get(SITE_WEIGHT, 1.0))) for meta, delta in updates])
