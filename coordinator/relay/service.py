"""A relay coordinator's domain logic: its workers, their queued updates, the cache, the forwarder.

It stands where ``coordinator.service.Coordinator`` stands in the root's app (``app.extensions
["fedmoe"]``), with the attributes the shared pieces use: ``config`` and ``blobs`` (request bodies,
``coordinator.api.requests.receive_body``), ``record_event`` and ``list_workers`` (``coordinator.access.auth``).
"""
from __future__ import annotations

import logging
import socket
import sqlite3
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from collections.abc import Callable
from typing import Any

from coordinator.access import audit
from coordinator.checks.adapters import checked_norm, stored_deltas
from coordinator.storage.audit_log import Event
from coordinator.storage.blobs import BlobStore, storage_errors
from coordinator.diffs import DiffCache
from coordinator.relay.checks import RelayChecks
from coordinator.relay.dp_cohorts import cohort_noise
from coordinator.relay.diffs import CachedVersions
from coordinator.relay.config import RelayConfig
from coordinator.relay.forwarder import Forwarder
from coordinator.relay.site import SITE_WEIGHT, SiteModel
from coordinator.relay.relay_store import APPLIED_ELSEWHERE, RelayStore
from coordinator.relay.upstream import RelayStartError, UpstreamClient, WeightsCache
from coordinator.liveness import liveness
from coordinator.service import check_body_size, receive_checked
from coordinator.checks.update_limits import NORM_SCALE, as_clipped
from privacy.secagg.aggregator import SecureAggregator
from protocol.errors import Conflict, InsufficientStorage, NotFound, Unavailable
from protocol.files import private_dir
from protocol.integrity import Readable, algorithm_of
from protocol.schemas import BaseModelSpec, ExpertSpec, UpdateMeta
from protocol.tensors import manifest_from_json

log = logging.getLogger(__name__)


class RelayService:
    def __init__(self, config: RelayConfig, port: int | None = None) -> None:
        self.relay_config = config
        self.config = config.coordinator
        data_dir = private_dir(self.config.data_dir)
        if config.join_token:  # workers join this relay with the root's join token (coordinator.access.tokens)
            _write_private(data_dir / "join_token", config.join_token)
        self.blobs = BlobStore(data_dir / "blobs")
        self.store = RelayStore(data_dir / "relay.sqlite")
        self.blobs_guard = threading.RLock()
        self.checks = RelayChecks(self.store, self.blobs, self.blobs_guard)
        self._push_lock = threading.Lock()
        self._guard = threading.Lock()
        self._creating: dict[str, threading.Lock] = {}
        """One lock per expert name a worker asked to create (a name is checked before it gets one)."""
        self.relay_id = config.relay_id or self.store.relay_id(_default_relay_id(port))
        self.upstream = UpstreamClient(config.upstream, config.join_token, data_dir / "relay_token",
                                       relay_join_token=config.relay_join_token)
        self.cache = WeightsCache(self.store, self.blobs, self.upstream, config.revalidate_seconds,
                                  self.drop_unreferenced, diff_pulls=config.upstream_diffs)
        self.site = (SiteModel(self.store, self.blobs, self.cache.get, lambda update_id: self.upstream.updates.status(update_id).get("applied_version"),
                               config.forward.staleness_decay, config.coordinator.async_alpha) if config.site_model else None)
        self.forwarder = Forwarder(self.relay_id, self.store, self.blobs, self.upstream, self.cache, config.forward,
                                   self.drop_unreferenced, self.report, self.blobs_guard, self.checks, self.site)
        self.versions = CachedVersions(self.cache, self.blobs)
        self.diffs = DiffCache(self.versions)
        self.bytes_served = 0
        """Bytes of weights and diffs sent to workers from this relay's cache (none of it crossed the long link)."""
        self.diff_bytes_served = 0
        self.diffs_unavailable = 0
        """Diff pulls answered 404 (a ``since`` not held here): the worker pulls full weights from the cache."""
        self.on_close: list[Callable[[], None]] = []
        """Stopped before the rest (e.g. the secure-aggregation applier, coordinator.cohorts)."""
        self.cohort_aggregator: SecureAggregator | None = None
        """With --secure-aggregation: the site's cohorts, told the root's DP settings once they are known."""
        _remove_orphan_blobs(self.store, self.blobs)

    def join_upstream(self) -> dict[str, Any]:
        """Register with the root (RelayStartError if it refuses, e.g. another base model), start forwarding."""
        fingerprint = self.relay_config.base_model_fingerprint
        base = {"id": "relay-pinned", "fingerprint": fingerprint} if fingerprint else None
        try:
            info = self.upstream.register_relay(self.relay_id, self.relay_config.advertise_url, base)
            self.checks.learn(info.get("limits"))
        except Unavailable as exc:
            if self.upstream.relay_token is None:  # never joined: nothing to forward with
                raise RelayStartError(f"cannot reach the upstream {self.relay_config.upstream} to join it: "
                                      f"{exc}") from None
            log.warning("upstream unreachable (%s); accepting and queueing, forwarding once it is back", exc)
            info = {}
        # the site's cohorts take the root's DP settings as last learned (coordinator/relay/dp_cohorts.py);
        # RelayStartError if this relay's --secure-aggregation cannot work with the root's DP
        noise = cohort_noise(self.checks.limits, self.config.secagg is not None)
        if self.cohort_aggregator is not None:
            self.cohort_aggregator.announce_dp(noise)
        self.forwarder.start()
        return info

    def close(self) -> None:
        for stop in self.on_close:
            stop()
        self.forwarder.close()
        self.cache.close()
        self.upstream.close()
        self.store.close()

    # coordinator.api.requests.WorkerFacing: what the views shared with the root use -------------

    def check_body_size(self, length: int | None) -> None:
        check_body_size(length, self.config.max_body_bytes)

    def receive_body(self, stream: Readable, length: int | None, expected_digest: str | None,
                     spooled: Any = None) -> Path:
        """As the root's: a fsynced temp file, 413 past --max-body-mb, 400 on a digest mismatch, 507 on a full disk."""
        with storage_errors("receive the request body"):
            return receive_checked(self.blobs, stream, length, self.config.max_body_bytes, expected_digest, spooled)

    def record_event(self, event: Event) -> None:
        """Add an event to the relay's audit log (``GET /api/v1/events``, as at the root); never raises."""
        try:
            self.store.add_event(event)
        except Exception:  # noqa: BLE001 - the audit log must not turn the answer into a 5xx
            log.exception("could not record %s event", event.kind)

    def events(self, limit: int, after: int | None = None, expert: str | None = None,
               kind: str | None = None) -> list[dict[str, Any]]:
        return self.store.events(limit, after, expert, kind)

    def list_workers(self) -> list[dict[str, Any]]:
        now = time.time()
        return [w | {"status": liveness(now - w["last_seen"], w["sync_interval"])} for w in self.store.workers()]

    def drop_unreferenced(self, digests: list[str]) -> None:
        with self.blobs_guard:
            referenced = self.store.referenced_blobs()
            for digest in set(digests) - referenced:
                self.blobs.delete(digest)

    # workers ------------------------------------------------------------------

    def register_worker(self, worker_id: str, specialty: str, base_model: BaseModelSpec,
                        sync_interval: float | None) -> dict[str, Any]:
        pinned = self.relay_config.base_model_fingerprint
        if pinned and base_model.fingerprint != pinned:
            raise Conflict(f"worker {worker_id!r} runs base model {base_model.id!r} (fingerprint "
                           f"{base_model.fingerprint[:12]}) but this relay serves fingerprint {pinned[:12]}; use "
                           "the same --base-model")
        try:
            expert: dict[str, Any] | None = self.expert_info(specialty)
        except NotFound:
            expert = None
        if expert is not None and expert["base_model"]["fingerprint"] != base_model.fingerprint:
            raise Conflict(f"worker {worker_id!r} runs base model {base_model.id!r} (fingerprint "
                           f"{base_model.fingerprint[:12]}) but expert {specialty!r} was trained from "
                           f"{expert['base_model']['id']!r} ({expert['base_model']['fingerprint'][:12]}); use the "
                           "same --base-model")
        self.store.upsert_worker(worker_id, specialty, {"id": base_model.id, "fingerprint": base_model.fingerprint},
                                 sync_interval)
        return {"worker_id": worker_id, "specialty": specialty, "expert": expert, "relay": self.relay_id}

    def heartbeat(self, worker_id: str) -> None:
        if not self.store.touch_worker(worker_id):
            raise NotFound(f"no worker {worker_id!r}; register first (POST /api/v1/workers)")

    def report(self) -> None:
        workers = [{"worker_id": w["worker_id"], "specialty": w["specialty"], "status": w["status"]}
                   for w in self.list_workers()]
        stats = self.store.stats() | {"bytes_served": self.bytes_served, "bytes_fetched": self.cache.bytes_fetched,
                                      "diff_bytes_served": self.diff_bytes_served,
                                      "diffs_unavailable": self.diffs_unavailable,
                                      "full_fetches": self.cache.upstream_fetches,
                                      "diff_fetches": self.cache.diff_fetches}
        self.upstream.report(self.relay_id, workers, stats)

    # experts ------------------------------------------------------------------

    def manifest(self, name: str) -> list[tuple[str, tuple[int, ...]]]:
        """The expert's tensor names and shapes, from the cached weights' header (fetched upstream if needed)."""
        cached = self.cache.known(name) or self.cache.get(name)
        return list(manifest_from_json(self.versions.manifest_json(cached.blob)))

    def expert_info(self, name: str) -> dict[str, Any]:
        try:
            return self.upstream.passthrough("GET", f"/experts/{name}")
        except Unavailable:
            cached = self.cache.known(name)
            if cached is None:
                raise
            return cached.info | {"version": cached.version, "versions": []}

    def list_experts(self) -> list[dict[str, Any]]:
        try:
            return self.upstream.passthrough("GET", "/experts")["experts"]
        except Unavailable:
            return [c.info | {"version": c.version} for c in self.store.cached_experts()]

    def create_expert(self, name: str, spec: ExpertSpec, body: Path) -> tuple[dict[str, Any], int]:
        """Answered from the cache when the expert exists with this setup (the adapter is not sent on);
        otherwise sent upstream, which creates it or answers 409.

        One creation per expert at a time: a site's workers start together and each asks to create the expert;
        unserialised, each sent its adapter over the WAN before the first had created it (bench.wan: up to 3 x
        9.8 MB per site, ~60 MB of a run's ~220 MB root ingress). The others now wait and find it cached."""
        with self._guard:
            creating = self._creating.setdefault(name, threading.Lock())
        try:
            with creating:
                try:  # an expert upstream already has is only fetched (egress), never uploaded again (ingress)
                    cached = self.cache.known(name) or self.cache.get(name)
                except NotFound:
                    cached = None
                if cached is not None and _same_setup(cached.info, spec):
                    return cached.info | {"version": cached.version}, 200
                response = self.upstream.create_expert_from_file(name, body, spec.to_json())
                return response.json(), response.status_code
        finally:
            self.blobs.forget(body)

    def weights_diff(self, name: str, since: int, codec: str, codec_config: dict[str, Any],
                     version: int | None = None) -> tuple[bytes, int]:
        """As the root's ``Coordinator.weights_diff``, from the versions this relay holds (coordinator/relay/diffs.py):
        (payload, version), an empty payload when ``since`` is that version; NotFound when one is not held."""
        if self.site is not None:
            self.diffs_unavailable += 1
            raise NotFound(f"this relay serves its site's weights of {name!r}, not the root's versions: pull them "
                           "in full (over the site's network)")
        if since > self.cache.get(name).version:  # the worker saw a newer version elsewhere: catch up if due
            self.cache.get(name, wait=True)
        try:
            return self.diffs.get(name, since, codec, codec_config, version)
        except NotFound:
            self.diffs_unavailable += 1
            raise

    def record_pull(self, worker_id: str | None, name: str, body_bytes: int) -> None:
        """A diff served (the root's view calls it, coordinator.api.routes.weights_diff_response)."""
        self.bytes_served += body_bytes
        self.diff_bytes_served += body_bytes

    # updates ------------------------------------------------------------------

    def room_for(self, size: int) -> None:
        limit = int(self.relay_config.max_queue_mb * (1 << 20))
        held = self.store.queued_bytes()
        if held + size > limit:
            raise InsufficientStorage(f"the relay holds {held} bytes of updates for forwarding and takes at most "
                                      f"{limit} (--max-queue-mb); its upstream may be unreachable. Retry later",
                                      retry_after=30)

    # resumable uploads (coordinator.api.uploads.UploadTarget): the root's routes, finishing into submit_update

    def check_upload(self, name: str, size: int) -> None:
        """An upload is opened only for an expert upstream has (or the cache knows) and a body the queue can hold."""
        if self.cache.known(name) is None:
            self.cache.get(name)  # NotFound if upstream has no such expert
        self.room_for(size)

    def recorded_update(self, update_id: str) -> tuple[str, str | None] | None:
        known = self.store.update(update_id)
        return None if known is None else (known["expert"], known["body_sha256"])

    def submit_upload(self, name: str, meta: UpdateMeta, part: Path, digest: str) -> tuple[dict[str, Any], bool]:
        with storage_errors("receive the upload"):
            body = self.blobs.link_received(part, digest)
        return self.submit_update(name, meta, body)

    def submit_update(self, name: str, meta: UpdateMeta, body: Path) -> tuple[dict[str, Any], bool]:
        """Record a worker's update durably (then 202); the same update_id again is a 200, applied once."""
        try:
            digest = self.blobs.digest_of(body)
            known = self.store.update(meta.update_id)
            if known is not None:
                return self._seen_before(known, name, digest, body), False
            cached = self.cache.known(name) or self.cache.get(name)
            # the root's own check (its fused norms): l2_norm over FileTensors reopened the file for each of a
            # smollm2 adapter's 420 tensors, 0.29 of the 0.40 s a 9.8 MB push took here; and the manifest from the
            # cached file's header, not from loading its 9.8 MB
            manifest = manifest_from_json(self.versions.manifest_json(cached.blob))
            norm = checked_norm(body, meta.codec, meta.codec_config, manifest)  # 4xx: not finite, not this expert's
            verdict = self.checks.judge(name, norm)  # 422 in the root's --norm-check reject mode
            stored = meta.to_json() | ({NORM_SCALE: verdict.scale} if verdict.clipped else {})
            delta = as_clipped(stored_deltas(body, meta.codec, meta.codec_config, manifest), stored)
            if self.site is None:  # 422 if a step of it would overflow (with the site model: SiteModel.admit)
                self.checks.check_step(cached, delta, meta.update_id, name)
            else:
                stored[SITE_WEIGHT] = self.site.weight_for(name, meta.worker_id)
            size = body.stat().st_size
            with self._push_lock:
                known = self.store.update(meta.update_id)  # a concurrent retry may have won
                if known is not None:
                    return self._seen_before(known, name, digest, body), False
                self.room_for(size)
                with self.blobs_guard, storage_errors(f"record update {meta.update_id!r}"), \
                        (self.site.lock if self.site is not None else nullcontext()):
                    owed = None if self.site is None else \
                        self.site.admit(name, cached, delta, stored[SITE_WEIGHT], self.checks, meta.update_id)
                    blob = self.blobs.adopt(body, digest)
                    try:
                        self.store.add_update(name, stored, blob, size, verdict.accepted_norm,
                                              audit.update_accepted(name, meta, verdict, size))
                    except (sqlite3.Error, OSError):
                        self.drop_unreferenced([blob])
                        raise
                    if self.site is not None and owed is not None:
                        self.site.added(name, owed)
            self.forwarder.notify()
        finally:
            self.blobs.forget(body)
        return self.update_status(meta.update_id), True

    def _seen_before(self, known: dict[str, Any], name: str, digest: str, body: Path) -> dict[str, Any]:
        if known["expert"] != name:
            raise Conflict(f"update_id {known['update_id']!r} was already used for expert {known['expert']!r}")
        if algorithm_of(known["body_sha256"]) != algorithm_of(digest):  # e.g. a one-shot push, then an upload
            digest = self.blobs.digest_of(body, algorithm_of(known["body_sha256"]))
        if known["body_sha256"] != digest:
            raise Conflict(f"update_id {known['update_id']!r} was already used for a different body; a retry must "
                           "resend the same bytes, and a new update needs a new update_id",
                           update_id=known["update_id"])
        return self.update_status(known["update_id"])

    def update_status(self, update_id: str) -> dict[str, Any]:
        row = self.store.update(update_id)
        if row is None:
            raise NotFound(f"no update with id {update_id!r} on this relay")
        status = "queued" if row["batch"] is None else \
            APPLIED_ELSEWHERE if row["batch_status"] == "superseded" else row["batch_status"]
        return {"update_id": update_id, "expert": row["expert"], "status": status, "relay": self.relay_id,
                "forwarded_as": row["batch_id"]}


def _same_setup(info: dict[str, Any], spec: ExpertSpec) -> bool:
    mine = spec.to_json()
    return (info.get("kind", "lora") == mine["kind"] and info.get("lora") == mine["lora"]
            and info.get("full") == mine.get("full")
            and info.get("base_model", {}).get("fingerprint") == spec.base_model.fingerprint)


def _write_private(path: Path, text: str) -> None:
    if path.is_file() and path.read_text().strip() == text:
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text + "\n")
    tmp.chmod(0o600)
    tmp.replace(path)


def _default_relay_id(port: int | None) -> str:
    host = "".join(c if c.isalnum() or c in "_.-" else "-" for c in socket.gethostname())[:48] or "relay"
    return f"{host}-{port}" if port else host


def _remove_orphan_blobs(store: RelayStore, blobs: BlobStore) -> None:
    """Blobs written just before a crash and never recorded (a batch not committed): safe to delete."""
    orphans = set(blobs.digests()) - store.referenced_blobs()
    for digest in orphans:
        blobs.delete(digest)
    if orphans:
        log.info("removed %d unrecorded blob(s) left by an interrupted write", len(orphans))
