"""Forwarding: one combined update per expert upstream per forward interval.

At most once per interval (at once when an update reaches an idle relay), for each expert with work:
a batch still pending (built before a crash or an outage) is resent as stored; otherwise the queued
worker updates are combined with the root's own rule, FedBuff's staleness-weighted sample mean
(``coordinator.aggregation.fedbuff`` applied to zeros: sum_i (n_i / N) * s(tau_i) * delta_i, tau_i =
cached root version - the version the worker started from; with ``--site-model`` the sum of the weights
each update had in the site model, coordinator/relay/site.py), compressed with the relay's codec plus
error feedback, recorded durably (``RelayStore.add_batch``) and sent under the update id ``<relay id>.<epoch>.<expert>.<seq>``.
The root deduplicates update ids, so resending after a timeout or a kill -9 applies it once.

Exactly once across relays: a batch's metadata names its members (worker update id -> body content
id, ``UpdateMeta.members``, at most ``MAX_BATCH_MEMBERS``). The root records them with the batch in
one transaction and refuses (409, ``reason: members_applied``, the ids in ``members``) a batch naming
an update it already has, from another relay or pushed to it directly after a worker failed over.
The relay then drops those members and re-sends the rest as a new batch (``_supersede``).

Refusals: a worker update was acknowledged (202) after the root's own checks (coordinator/relay/checks.py), and
each batch is checked again before it is sent (``_check``). A batch the root refuses all the same for its contents
(a 4xx: its step would overflow on weights that moved meanwhile, its norm is over the root's limit) is split in
halves, each sent at once under a new id, until the update the root refuses is alone: that one is refused for good,
the others reach the root (``_refused``; ``RelayStore.split_batch``). Before, the whole batch was dropped with every
member: one worker pushing deltas of 3e38 cost 6 of 9 honest updates that had their 202. A refusal of the request
rather than of the batch (401, 403, 408) keeps the batch for the next cycle.
"""
from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from compression.error_feedback import ErrorFeedback
from compression.registry import make_codec
from coordinator.access import audit
from coordinator.aggregation import AggregationParams, Update, fedbuff
from coordinator.aggregation.base import weighted_sum
from coordinator.storage.blobs import BlobStore
from coordinator.relay.checks import RelayChecks
from coordinator.relay.site import SiteModel, sum_weighted
from coordinator.relay.relay_store import RelayStore, held_deltas
from coordinator.relay.relay_store_schema import Batch
from coordinator.relay.upstream import UpstreamClient, WeightsCache
from protocol.errors import Conflict, FedMoEError, Forbidden, NotFound, RequestTimeout, Unauthorized, Unavailable
from protocol.schemas import MAX_BATCH_MEMBERS, RAW_CODEC, UPDATE_ID_RE
from protocol.streaming import read_header
from protocol.tensors import StateDict, dumps, loads

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardPolicy:
    interval: float = 10.0
    """Seconds between forwards upstream."""
    codec: str = RAW_CODEC
    """Codec of the combined update (safetensors = lossless, no error feedback)."""
    codec_config: dict[str, Any] | None = None
    staleness_decay: float = 0.1
    """Worker updates weigh 1 / (1 + decay * staleness) in the combination (as at the root)."""
    on_exit: bool = False
    """Forward what is queued once more when the relay stops (after it stopped taking requests)."""


FORWARDED, REFUSED, SUPERSEDED, SPLIT, KEPT = "forwarded", "refused", "superseded", "split", "kept"
MAX_SENDS = 24
"""Batches one expert may send in one cycle: a superseded batch is rebuilt at once, and a refused one's halves go at
once (bisection isolates one bad member of MAX_BATCH_MEMBERS = 256 in 2 x 8 sends), not one per interval."""
NOT_ABOUT_CONTENTS = (Unauthorized, Forbidden, RequestTimeout)
"""Refusals of the request, not of the batch: it is kept as it is and sent again next cycle (never dropped)."""


def batch_update_id(relay_id: str, epoch: str, expert: str, seq: int) -> str:
    """Deterministic: the same batch always goes upstream under the same id."""
    update_id = f"{relay_id}.{epoch}.{expert}.{seq}"
    if UPDATE_ID_RE.fullmatch(update_id):
        return update_id
    return f"{relay_id[:40]}.{epoch}.{hashlib.sha256(expert.encode()).hexdigest()[:16]}.{seq}"


def combine(updates: list[tuple[dict[str, Any], StateDict | Any]], manifest: list[tuple[str, tuple[int, ...]]],
            version: int, staleness_decay: float) -> StateDict:
    """FedBuff's weighted mean of the workers' deltas (the root's code, applied to zeros)."""
    zeros = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in manifest}
    entries = [Update(delta=delta, num_samples=meta["num_samples"], staleness=max(0, version - meta["base_version"]))
               for meta, delta in updates]
    return fedbuff(zeros, entries, AggregationParams(1.0, staleness_decay))


class Forwarder:
    def __init__(self, relay_id: str, store: RelayStore, blobs: BlobStore, upstream: UpstreamClient,
                 cache: WeightsCache, policy: ForwardPolicy, drop_unreferenced: Callable[[list[str]], None],
                 report: Callable[[], None], blobs_guard: threading.RLock, checks: RelayChecks,
                 site: SiteModel | None = None) -> None:
        self.relay_id, self.epoch = relay_id, store.epoch()
        self.checks = checks
        """The root's rules, applied to a batch before it is sent (coordinator/relay/checks.py)."""
        self.store, self.blobs, self.upstream, self.cache = store, blobs, upstream, cache
        self.policy = policy
        self.drop_unreferenced = drop_unreferenced
        self.report = report
        self.blobs_guard = blobs_guard
        self.site = site
        """With a site model, a batch is the sum of its members' weighted deltas (coordinator/relay/site.py)."""
        self._codec = None if policy.codec == RAW_CODEC else make_codec(policy.codec, policy.codec_config or {})
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._cycle_lock = threading.Lock()
        self._clock: Callable[[], float] = time.monotonic
        self._thread: threading.Thread | None = None
        self.upstream_reachable = True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="fedmoe-relay-forward", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def notify(self) -> None:
        """A worker update was recorded: an idle relay forwards it at once (see ``_loop``)."""
        self._wake.set()

    def _loop(self) -> None:
        """At most one forwarding cycle with work per ``policy.interval``, as soon as allowed.

        With updates queued, a cycle starts ``policy.interval`` after the previous one with work *started*
        (back to back when a cycle takes longer: waiting the interval after each cycle made the period
        interval + cycle, 35 s, not 10, for 9.8 MB batches on a loaded machine, docs/history/wan.md). An update that
        reaches an idle relay (no cycle with work for an interval) goes at once instead of waiting for the
        next tick of a fixed clock: on average half an interval sooner, the first one of a run included.
        The relay's start counts as a cycle with work: after a (re)start, updates gather for one interval.
        Without work a cycle still runs every interval, for the report upstream.
        """
        last_work = last_cycle = self._clock()
        while not self._stop.is_set():
            has_work = bool(self.store.experts_with_work())
            due = (last_work if has_work else last_cycle) + self.policy.interval
            if self._clock() < due:
                # a recorded update wakes us early (notify), to look again: it may be the first of an idle spell
                self._wake.wait(due - self._clock())
                self._wake.clear()
                continue
            if self._stop.is_set():
                return
            last_cycle = self._clock()
            if has_work:
                last_work = last_cycle
            try:
                self.forward_once()
            except Exception:  # noqa: BLE001 - the loop must outlive one bad cycle; the next retries
                log.exception("forwarding cycle failed; retrying next interval")

    def forward_once(self) -> int:
        """One cycle: at most one batch per expert upstream, then the report. Batches delivered."""
        delivered = 0
        with self._cycle_lock:
            for expert in self.store.experts_with_work():
                try:
                    for _ in range(MAX_BATCH_MEMBERS if self.checks.limits.dp else MAX_SENDS):
                        batch = self.store.pending_batch(expert) or self._build(expert)
                        outcome = None if batch is None else self._send(batch)
                        delivered += outcome == FORWARDED
                        if not self._again_now(expert, outcome):
                            break
                except Unavailable as exc:
                    self.upstream_reachable = False
                    log.warning("upstream unreachable (%s); %d byte(s) stay queued for later", exc,
                                self.store.queued_bytes())
                    break
            try:
                self.report()
                self.upstream_reachable = True
            except Unavailable:
                self.upstream_reachable = False
            except FedMoEError as exc:
                log.warning("upstream refused the relay's report: %s", exc)
        return delivered

    def _again_now(self, expert: str, outcome: str | None) -> bool:
        """Send another batch of ``expert`` in this cycle: one rebuilt from a superseded batch's other members, the
        next half of a refused batch (they were due already; one per interval would take 16 intervals), or under the
        root's DP the next worker's update."""
        if outcome in (SUPERSEDED, SPLIT):
            return True
        if outcome in (FORWARDED, REFUSED) and self.checks.limits.dp:  # one worker's update per batch: all of them
            return bool(self.store.next_members(expert, 1))
        return outcome in (FORWARDED, REFUSED) and self.store.has_split_groups(expert)

    def _build(self, expert: str) -> Batch | None:
        # Under the root's worker-level DP, the root clips each worker's contribution: a batch is one worker's update,
        # forwarded lossless (an error-feedback residual would carry one worker's update into another's).
        private = self.checks.limits.dp
        queued = self.store.next_members(expert, MAX_BATCH_MEMBERS)  # the rest go in the next batches
        queued = queued[:1] if private else queued  # (a refused batch's half from before the root ran DP, too)
        if not queued:
            return None
        # The version staleness is measured against, and the batch's base: the cached one, revalidated in the
        # background. Waiting for a fresh copy put a full download of each new root version (9.8 MB, ~4 s over
        # 20 Mbit/s) in every cycle, so a relay forwarded every ~5.5 s whatever its interval (docs/history/wan.md). A stale
        # base gives about the same weights: the root discounts the batch by what the relay's discount left out,
        # s(root - cached) * s(cached - base_i), against s(root - base_i) with a fresh base.
        cached = self.cache.get(expert)
        manifest = read_header(self.blobs.path(cached.blob)).manifest
        deltas = [(u.meta, held_deltas(self.blobs, u, manifest)) for u in queued]
        combined = (sum_weighted(deltas, manifest) if self.site is not None
                    else combine(deltas, manifest, cached.version, self.policy.staleness_decay))
        seq = self.store.next_seq(expert)
        payload, residual = (dumps(combined), None) if private else self._encode(expert, combined, manifest, seq)
        samples = sum(u.meta["num_samples"] for u in queued)
        meta = {"update_id": batch_update_id(self.relay_id, self.epoch, expert, seq), "base_version": cached.version,
                "num_samples": samples, "train_loss": _mean_loss([u.meta for u in queued]),
                "codec": RAW_CODEC if private else self.policy.codec,
                "codec_config": {} if private else self.policy.codec_config or {},
                "members": {u.update_id: u.body_digest for u in queued}}
        if private and queued[0].meta.get("dp_cohort"):  # a DP cohort's sum (coordinator/relay/dp_cohorts.py)
            meta["dp_cohort"] = queued[0].meta["dp_cohort"]
        elif private and queued[0].meta.get("worker_id"):
            meta["worker_id"] = queued[0].meta["worker_id"]  # whose contribution the root clips
        old_residual = self.store.residual(expert)
        with self.blobs_guard:  # adopted and recorded together: a sweep never sees them unreferenced
            digest = self.blobs.put_bytes(payload)
            residual_blob = None if residual is None else self.blobs.put_bytes(dumps(residual))
            batch = Batch(expert, seq, meta["update_id"], meta, digest, len(payload), len(queued),
                          sum(u.size for u in queued))
            # the old residual stays referenced by the batch until the root answers (see _supersede)
            self.store.add_batch(batch, [u.update_id for u in queued], residual_blob, prev_residual=old_residual)
        log.info("batch %s: %d update(s) of %s (%d bytes) combined into %d bytes", meta["update_id"], len(queued),
                 expert, batch.member_bytes, len(payload))
        return batch

    def _encode(self, expert: str, combined: StateDict, manifest: list, seq: int) -> tuple[bytes, StateDict | None]:
        if self._codec is None:
            return dumps(combined), None
        feedback = ErrorFeedback(self._codec)
        residual = self.store.residual(expert)
        if residual is not None:
            feedback.load_state_dict(loads(self.blobs.path(residual).read_bytes()))
        payload = feedback.compress(combined, manifest, seed=seq).payload
        return payload, feedback.state_dict()

    def _send(self, batch: Batch) -> str:
        """Push ``batch`` upstream: FORWARDED; SUPERSEDED (some members reached the root another way: the rest
        rebuilt now); SPLIT (refused for its contents: its halves go next), REFUSED (a batch of one refused: dropped
        for good); KEPT (the request was refused, not the batch: sent again next cycle)."""
        try:
            self._check(batch)  # the root's step rule, here: a batch it would refuse costs no upload
            status = self.upstream.updates.push(batch.expert, self.blobs.path(batch.blob).read_bytes(), batch.meta)
        except Unavailable:
            raise
        except NOT_ABOUT_CONTENTS as exc:
            log.warning("upstream refused the request carrying batch %s (%s); it is kept and sent again next "
                        "cycle", batch.update_id, exc)
            return KEPT
        except Conflict as exc:
            elsewhere = set(exc.details.get("members") or []) & set(batch.meta.get("members") or {})
            if exc.details.get("reason") == "members_applied" and elsewhere:
                self._supersede(batch, elsewhere)
                return SUPERSEDED
            return self._refused(batch, exc)
        except FedMoEError as exc:
            return self._refused(batch, exc)
        if self.site is not None:
            self.site.forwarded(batch.expert, batch.update_id, self._decoded(batch), status.get("applied_version"))
        self.drop_unreferenced(self.store.batch_done(batch, "forwarded"))
        log.info("forwarded %s upstream (%d bytes for %d worker update(s))", batch.update_id, batch.size,
                 batch.members)
        return FORWARDED

    def _decoded(self, batch: Batch) -> StateDict:
        """What the root decodes of ``batch`` (its payload through the forward codec), in fp32."""
        cached = self.cache.known(batch.expert) or self.cache.get(batch.expert)
        manifest = read_header(self.blobs.path(cached.blob)).manifest
        return weighted_sum(manifest, [(held_deltas(self.blobs, batch, manifest), 1.0)])

    def _check(self, batch: Batch) -> None:
        """InvalidUpdate (422) if the root would refuse ``batch`` by its step rule: the batch as the root decodes it,
        added to the cached root weights, must stay finite (they may have moved since its members' 202s)."""
        cached = self.cache.known(batch.expert) or self.cache.get(batch.expert)
        self.checks.check_step(cached, self._decoded(batch), batch.update_id, batch.expert)

    def _refused(self, batch: Batch, exc: FedMoEError) -> str:
        """The root refused ``batch`` (or would, ``_check``): retrying the same bytes cannot help, but its members
        may be refused for one of them. Split into halves, each sent as a batch of its own, until the member the
        root refuses is alone; that one is refused for good, with an audit row naming it. A 404 (the expert is gone
        upstream) is every member's answer: refused whole."""
        if batch.members > 1 and not isinstance(exc, NotFound):
            log.warning("upstream refused batch %s of %d worker updates (%s); sending it again in two halves",
                        batch.update_id, batch.members, exc)
            self.drop_unreferenced(self.store.split_batch(batch))
            outcome = SPLIT
        else:
            log.error("upstream refused batch %s (%d worker update(s)) for good: %s", batch.update_id, batch.members,
                      exc)
            events = tuple(audit.update_refused_upstream(batch.expert, update_id, self.store.worker_of(update_id),
                                                         batch.update_id, exc)
                           for update_id in batch.meta.get("members") or {})
            self.drop_unreferenced(self.store.batch_done(batch, "refused", events))
            outcome = REFUSED
        if self.site is not None:  # the site owes what the refused batch held: rebuilt from the queue
            self.site.reset(batch.expert)
        return outcome

    def _supersede(self, batch: Batch, elsewhere: set[str]) -> None:
        """The root already has ``elsewhere`` (a worker failed over and pushed them again via another relay or
        directly): retire the batch and queue its other members again, for a new batch under the next id.

        Error feedback: the batch was encoded as C(combined + R_old), leaving R_new = combined + R_old -
        decode(C). The root applied none of it, so R_new is wrong twice over: it would forget R_old (the
        error the root still owes from earlier batches) and it holds the dropped members' share of
        ``combined`` (minus what C kept), which a later batch would then send again. So the residual goes
        back to R_old, and the rebuilt batch re-weights the remaining members alone (FedBuff's n_i / N over
        their own samples) and encodes them on top of R_old: each update reaches the root once, via one path.
        """
        log.warning("upstream already has %d of the %d worker update(s) in batch %s (a worker failed over and "
                    "pushed them again elsewhere): dropping them and re-sending the rest", len(elsewhere),
                    batch.members, batch.update_id)
        self.drop_unreferenced(self.store.supersede_batch(batch, elsewhere))
        if self.site is not None:
            self.site.reset(batch.expert)

    def flush(self) -> int:
        """Forward now (tests; the loop does this every interval)."""
        return self.forward_once()


def _mean_loss(metas: list[dict[str, Any]]) -> float | None:
    pairs = [(m.get("train_loss"), max(1, m["num_samples"])) for m in metas if m.get("train_loss") is not None]
    if not pairs:
        return None
    total = sum(n for _, n in pairs)
    loss = math.fsum(v * (n / total) for v, n in pairs)
    return loss if math.isfinite(loss) else None
