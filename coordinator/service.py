"""The coordinator's domain logic, free of HTTP: experts, updates, aggregation.

Flow of a push: the body is already in a fsynced temp file (the API put it
there); we decode and check it, move it into the blob store, record it as
pending in SQLite (that commit is the point of no loss: only then is 202 sent),
then aggregate whatever the policy says is ready. Aggregation runs under a
per-expert lock, writes the new version's blob, then commits the version row
and marks the applied updates in one transaction. A restart re-runs
aggregation over the pending rows, so nothing acknowledged is lost and nothing
is applied twice.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compression.wire import encode_update
from coordinator.adapters import (check_full_weights, check_lora_adapter, check_update, make_codec_or_400,
                                  stored_deltas)
from coordinator.aggregation import AGGREGATORS, AggregationParams, StateDict, Update, l2_norm, robust_aggregator
from coordinator import audit
from coordinator.audit import Event
from coordinator.blobs import BlobStore
from coordinator.config import CoordinatorConfig
from coordinator.gateway_builder import GatewayBuilder
from coordinator.norm_check import judge_norm
from coordinator.store import ExpertRow, ManifestStore, StaleAggregation, UpdateRow
from gateway.router import ProfileError, combine_profiles, profile_from_json
from gateway.router import route as route_prompt
from protocol.errors import BadRequest, Conflict, InvalidPayload, NotFound
from protocol.schemas import MAX_COUNT, BaseModelSpec, ExpertSpec, UpdateMeta, check_name
from protocol.streaming import FileTensors
from protocol.tensors import load_file, manifest_from_json, manifest_to_json, save_file

log = logging.getLogger(__name__)
DIFF_CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class WeightsRef:
    path: Path
    version: int
    digest: str


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        config.data_dir.mkdir(parents=True, exist_ok=True)
        self.blobs = BlobStore(config.data_dir / "blobs")
        self.db = ManifestStore(config.data_dir / "manifest.sqlite")
        self.params = AggregationParams(config.server_lr, config.staleness_decay)
        self._aggregate_fn = AGGREGATORS[config.aggregation]
        if config.robust != "none":  # a robust combination of fedbuff's buffer (coordinator.aggregation.robust)
            self._aggregate_fn = robust_aggregator(config.robust, config.trim_fraction)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        # Blobs are shared by digest across experts: adopting one and recording its row must not
        # interleave with dropping "unreferenced" blobs, or a new row could point at a deleted file.
        self.blobs_guard = threading.RLock()
        self._diffs: dict[tuple, bytes] = {}  # (expert, since, version, codec, config) -> encoded diff
        self._diff_lock = threading.Lock()
        self.gateway = GatewayBuilder(self)
        self.on_aggregated: Callable[[float], None] = lambda seconds: None
        """Called with the seconds each aggregation step took (metrics hook)."""
        self._remove_orphan_blobs()
        for expert in self.db.experts():  # finish what a crash interrupted
            self._aggregate(expert.name)
        self.gateway.start()

    def close(self) -> None:
        self.gateway.close()
        self.db.close()

    def _lock(self, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(name, threading.Lock())

    # experts ------------------------------------------------------------------

    def create_expert(self, name: str, spec: ExpertSpec, body: Path) -> tuple[dict[str, Any], bool]:
        """Create an expert from its first adapter; (info, created). Same spec again is a no-op."""
        check_name(name, "expert name")
        try:
            with self._lock(name):
                existing = self.db.expert(name)
                if existing is not None:
                    self._check_compatible(existing, spec)
                    return self.expert_info(name), False
                manifest = (check_full_weights(body, spec.full) if spec.full is not None
                            else check_lora_adapter(load_file(body), spec.lora))
                with self.blobs_guard:
                    digest = self.blobs.adopt(body)
                    self.db.create_expert(name, spec.to_json(), manifest_to_json(manifest), digest, events=(
                        audit.expert_created(name, spec.lora.rank if spec.lora else None, spec.base_model.id),))
        finally:
            self.blobs.forget(body)
        self.gateway.notify(urgent=True)
        log.info("created expert %s (%s)", name, "full-parameter" if spec.lora is None else f"rank {spec.lora.rank}")
        return self.expert_info(name), True

    def _check_compatible(self, expert: ExpertRow, spec: ExpertSpec) -> None:
        stored = ExpertSpec.from_json(expert.spec)
        if spec.kind != stored.kind:
            diffs = [f"kind {spec.kind!r} != expert's {stored.kind!r} (--lora-rank 0 makes a full-parameter expert)"]
        elif spec.lora is not None and stored.lora is not None:
            diffs = [f"{field} {getattr(spec.lora, field)!r} != expert's {getattr(stored.lora, field)!r}"
                     for field in ("rank", "alpha", "target_modules")
                     if getattr(spec.lora, field) != getattr(stored.lora, field)]
        else:
            diffs = [] if spec.full == stored.full else [f"full {spec.full} != expert's {stored.full}"]
        if spec.base_model.fingerprint != stored.base_model.fingerprint:
            diffs.append(f"base model {spec.base_model.id!r} (fingerprint {spec.base_model.fingerprint[:12]}) "
                         f"!= expert's {stored.base_model.id!r} ({stored.base_model.fingerprint[:12]})")
        if diffs:
            raise Conflict(f"expert {expert.name!r} exists with a different setup: " + "; ".join(diffs),
                           differences=diffs)

    def require_expert(self, name: str) -> ExpertRow:
        """The expert's row, or NotFound listing the known experts."""
        expert = self.db.expert(name)
        if expert is None:
            known = [e.name for e in self.db.experts()]
            raise NotFound(f"no expert named {name!r}; known experts: {known}")
        return expert

    def expert_info(self, name: str) -> dict[str, Any]:
        return self._info(self.require_expert(name))

    def list_experts(self) -> list[dict[str, Any]]:
        return [self._info(e) for e in self.db.experts()]

    def _info(self, e: ExpertRow) -> dict[str, Any]:
        return {"name": e.name, "version": e.version, **e.spec, "updates_applied": e.updates_applied,
                "samples_seen": e.samples_seen, "last_train_loss": e.last_train_loss,
                "pending_updates": self.db.pending_count(e.name),
                "created_at": e.created_at, "updated_at": e.updated_at}

    def versions(self, name: str) -> list[dict[str, Any]]:
        self.require_expert(name)
        return self.db.versions(name)

    def weights(self, name: str, version: int | None = None) -> WeightsRef:
        """Where version ``version`` (default: the current one) is stored; NotFound if absent or pruned."""
        expert = self.require_expert(name)
        exists, digest = self.db.version_blob(name, expert.version if version is None else version)
        while version is None and digest is None:  # replaced and pruned between the two reads
            expert = self.require_expert(name)
            exists, digest = self.db.version_blob(name, expert.version)
        version = expert.version if version is None else version
        if not exists:
            raise NotFound(f"expert {name!r} has no version {version} (current: {expert.version})")
        if digest is None:
            raise NotFound(f"version {version} of {name!r} was pruned; the newest "
                           f"{self.config.keep_versions} versions are kept (--keep-versions)")
        return WeightsRef(self.blobs.path(digest), version, digest)

    def weights_diff(self, name: str, since: int, codec: str, codec_config: dict[str, Any]) -> tuple[bytes, int]:
        """The current weights minus version ``since``, encoded with a compression codec.

        Lets a worker that holds version ``since`` catch up for a fraction of the bytes of a full
        pull. Returns (payload, current version); the payload is empty when nothing changed.
        """
        current = self.weights(name)
        if since == current.version:
            return b"", current.version
        old = self.weights(name, since)
        key = (name, since, current.version, codec, json.dumps(codec_config, sort_keys=True))
        with self._diff_lock:  # concurrent pulls of one diff wait for it: one model copy in memory, not N
            with self._locks_guard:
                cached = self._diffs.get(key)
            if cached is None:
                encoder = make_codec_or_400(codec, codec_config)
                diff, base = load_file(current.path), FileTensors(old.path)
                for k, t in diff.items():
                    t.sub_(base[k])
                cached = encode_update(diff, self.manifest(name), encoder, seed=current.version)
                with self._locks_guard:
                    self._diffs[key] = cached
                    # a handful of (since, codec) pairs cover a fleet; bounded in bytes for full experts
                    while len(self._diffs) > 16 or sum(map(len, self._diffs.values())) > DIFF_CACHE_BYTES:
                        self._diffs.pop(next(iter(self._diffs)))
        return cached, current.version

    def record_pull(self, worker_id: str | None, name: str, body_bytes: int) -> None:
        if worker_id:
            raw = 4 * sum(math.prod(shape) for _, shape in self.manifest(name))
            self.db.record_pull(worker_id, body_bytes, raw)

    def manifest(self, name: str) -> list[tuple[str, tuple[int, ...]]]:
        return manifest_from_json(self.require_expert(name).manifest)

    # updates ------------------------------------------------------------------

    def submit_update(self, name: str, meta: UpdateMeta, body: Path) -> tuple[dict[str, Any], bool]:
        """Record and (policy permitting) apply an update; (status, is_new).

        A retry (same update_id, same bytes) is a no-op answered with the stored status; the same
        update_id with different bytes is a 409, never silently taken for the first one.
        """
        try:
            expert = self.require_expert(name)
            body_digest = self.blobs.digest_of(body)
            known = self.db.update(meta.update_id)
            if known is not None:
                return self._seen_before(known, name, meta, body_digest), False
            if meta.base_version > expert.version:
                raise Conflict(f"base_version {meta.base_version} is ahead of expert {name!r}, "
                               f"which is at version {expert.version}")
            manifest = manifest_from_json(expert.manifest)
            # Raw bodies come back as a per-tensor view of the file (a second read, bounded memory);
            # compressed ones decoded once. Either way the decoded update is dropped before we wait
            # for the expert's lock, and read again from its blob when it is aggregated.
            norm = l2_norm(check_update(body, meta.codec, meta.codec_config, manifest))
            size = body.stat().st_size
            with self._lock(name):
                known = self.db.update(meta.update_id)  # a concurrent retry may have won
                if known is not None:
                    return self._seen_before(known, name, meta, body_digest), False
                verdict = judge_norm(norm, self.db.recent_norms(name, self.config.norm_history),
                                     self.config.norm_policy)  # InvalidUpdate (422) in reject mode
                stored = meta.to_json() | ({"norm_scale": verdict.scale} if verdict.clipped else {})
                with self.blobs_guard:
                    digest = self.blobs.adopt(body, body_digest)
                    self.db.add_update(name, stored, digest, size, _fp32_bytes(manifest), norm=verdict.accepted_norm,
                                       events=audit.update_accepted(name, meta, verdict, size))
                self._aggregate_locked(name)
        finally:
            self.blobs.forget(body)
        return self.update_status(meta.update_id), True

    def _seen_before(self, known: UpdateRow, name: str, meta: UpdateMeta, body_digest: str) -> dict[str, Any]:
        if known.expert != name:
            raise Conflict(f"update_id {known.update_id!r} was already used for expert {known.expert!r}")
        if known.body_sha256 is not None and known.body_sha256 != body_digest:
            raise Conflict(f"update_id {known.update_id!r} was already used for a different body; a retry "
                           "must resend the same bytes, and a new update needs a new update_id",
                           update_id=known.update_id)
        self.record_event(audit.update_duplicate(name, meta.worker_id, known.update_id, known.status))
        return self.update_status(known.update_id)

    def record_event(self, event: Event) -> None:
        """Add an event that records no other change; a failure to log is logged, never raised."""
        try:
            self.db.add_event(event)
        except Exception:  # noqa: BLE001 - the audit log must not turn the answer into a 5xx
            log.exception("could not record %s event", event.kind)

    def events(self, limit: int, after: int | None = None, expert: str | None = None,
               kind: str | None = None) -> list[dict[str, Any]]:
        return self.db.events(limit, after, expert, kind)

    def update_status(self, update_id: str) -> dict[str, Any]:
        row = self.db.update(update_id)
        if row is None:
            raise NotFound(f"no update with id {update_id!r}")
        expert = self.require_expert(row.expert)
        return {"update_id": row.update_id, "expert": row.expert, "status": row.status,
                "applied_version": row.applied_version, "expert_version": expert.version}

    def _aggregate(self, name: str) -> None:
        with self._lock(name):
            self._aggregate_locked(name)

    def _aggregate_locked(self, name: str) -> None:
        pending = self.db.pending_updates(name)
        k = self.config.updates_per_step
        while len(pending) >= k:
            if not self._apply(name, pending[:k]):
                return
            pending = pending[k:]

    def _apply(self, name: str, batch: list[UpdateRow]) -> bool:
        """One aggregation step; False if another process sharing the data dir got there first."""
        started = time.perf_counter()
        expert = self.require_expert(name)
        manifest = manifest_from_json(expert.manifest)
        current = load_file(self.weights(name).path)  # our own copy: the aggregator updates it in place
        try:
            updates = [Update(delta=self._deltas(u, manifest), num_samples=u.meta["num_samples"],
                              staleness=max(0, expert.version - u.meta["base_version"])) for u in batch]
        except (InvalidPayload, FileNotFoundError):  # raw payloads are opened here, others decoded
            if all(self.db.update(u.update_id).status == "pending" for u in batch):
                raise
            log.warning("dropped an aggregation step of %s: its updates were applied meanwhile", name)
            return False  # another process applied them and dropped their payloads
        new = self._aggregate_fn(current, updates, self.params)
        written = self.blobs.write_temp(lambda p: save_file(new, p))
        loss = _mean_loss(batch)
        with self.blobs_guard:
            digest = self.blobs.adopt(written)
            try:
                self.db.commit_version(name, expert.version + 1, digest, batch, loss, events=(audit.version_applied(
                    name, expert.version + 1, [u.update_id for u in batch], [u.staleness for u in updates], loss),))
            except StaleAggregation as exc:
                log.warning("dropped an aggregation step of %s: %s", name, exc)
                self._drop_unreferenced([digest])
                return False
        self._drop_unreferenced([u.blob for u in batch if u.blob]
                                + self.db.prune_versions(name, self.config.keep_versions))
        self.on_aggregated(time.perf_counter() - started)
        self.gateway.notify()
        log.info("expert %s -> version %d (%d update(s), staleness %s)", name, expert.version + 1,
                 len(batch), [u.staleness for u in updates])
        return True

    def _deltas(self, row: UpdateRow, manifest: list[tuple[str, tuple[int, ...]]]) -> StateDict:
        """Deltas read from the update's blob when aggregated (not kept in memory while pending)."""
        assert row.blob is not None, "a pending update always has its payload"
        deltas = stored_deltas(self.blobs.path(row.blob), row.meta["codec"], row.meta["codec_config"], manifest)
        scale = row.meta.get("norm_scale", 1.0)  # clipped at receipt (--norm-check clip)
        return deltas if scale == 1.0 else {k: t * scale for k, t in deltas.items()}

    def _drop_unreferenced(self, digests: list[str]) -> None:
        if not digests:
            return
        with self.blobs_guard:
            referenced = self.db.referenced_blobs()
            for digest in set(digests) - referenced:
                self.blobs.delete(digest)

    def _remove_orphan_blobs(self) -> None:
        """Blobs written just before a crash, never recorded: safe to delete."""
        orphans = set(self.blobs.digests()) - self.db.referenced_blobs()
        for digest in orphans:
            self.blobs.delete(digest)
        if orphans:
            log.info("removed %d unrecorded blob(s) left by an interrupted write", len(orphans))

    # routing ------------------------------------------------------------------

    def put_profile(self, name: str, worker_id: str, profile: dict[str, Any]) -> dict[str, Any]:
        """Store one worker's summary of its data (n-gram statistics, no examples) for routing."""
        self.require_expert(name)
        check_name(worker_id, "worker_id")
        try:
            vector, count = profile_from_json(profile)
        except ProfileError as exc:
            raise BadRequest(str(exc)) from None
        if not 1 <= count <= MAX_COUNT:
            raise BadRequest(f"profile num_examples must be in [1, {MAX_COUNT}], got {count}: "
                             "a profile of no examples cannot route")
        self.db.put_profile(name, worker_id, vector.astype("<f4").tobytes(), count)
        return {"expert": name, "worker_id": worker_id, "num_examples": count}

    def route(self, prompt: str, threshold: float | None = None) -> dict[str, Any]:
        """Pick the expert whose data the prompt resembles, or the gateway when unsure."""
        stored = self.db.profiles()
        if not stored:
            raise NotFound("no expert has a routing profile yet (workers send one when they join)")
        profiles = {name: combine_profiles([(np.frombuffer(v, dtype="<f4"), n) for v, n in rows])
                    for name, rows in stored.items()}
        threshold = self.config.route_threshold if threshold is None else threshold
        try:
            result = route_prompt(prompt, profiles, threshold)
        except ProfileError as exc:
            raise BadRequest(str(exc)) from None
        return {"expert": result.expert, "target": result.expert or "gateway", "confidence": result.confidence,
                "threshold": threshold, "scores": result.scores}

    # workers ------------------------------------------------------------------

    def register_worker(self, worker_id: str, specialty: str, base_model: BaseModelSpec,
                        sync_interval: float | None = None) -> dict[str, Any]:
        check_name(worker_id, "worker_id")
        check_name(specialty, "specialty")
        expert = self.db.expert(specialty)
        if expert is not None:
            stored = ExpertSpec.from_json(expert.spec).base_model
            if stored.fingerprint != base_model.fingerprint:
                raise Conflict(f"worker {worker_id!r} runs base model {base_model.id!r} (fingerprint "
                               f"{base_model.fingerprint[:12]}) but expert {specialty!r} was trained from "
                               f"{stored.id!r} ({stored.fingerprint[:12]}); use the same --base-model")
        self.db.upsert_worker(worker_id, specialty, {"id": base_model.id, "fingerprint": base_model.fingerprint},
                              sync_interval,
                              events=(audit.worker_registered(worker_id, specialty, base_model.id, sync_interval),))
        return {"worker_id": worker_id, "specialty": specialty,
                "expert": None if expert is None else self._info(expert)}

    def heartbeat(self, worker_id: str) -> None:
        if not self.db.touch_worker(worker_id):
            raise NotFound(f"no worker {worker_id!r}; register first (POST /api/v1/workers)")

    def list_workers(self) -> list[dict[str, Any]]:
        now = time.time()
        return [w | {"status": liveness(now - w["last_seen"], w["sync_interval"])} for w in self.db.workers()]


def liveness(silent_for: float, sync_interval: float | None) -> str:
    """alive: heard from within 3 sync intervals (30 s at least); stale: within 20 (5 min); else gone."""
    interval = sync_interval or 10.0
    if silent_for <= max(3 * interval, 30.0):
        return "alive"
    if silent_for <= max(20 * interval, 300.0):
        return "stale"
    return "gone"


def _fp32_bytes(manifest: list[tuple[str, tuple[int, ...]]]) -> int:
    return 4 * sum(math.prod(shape) for _, shape in manifest)


def _mean_loss(batch: list[UpdateRow]) -> float | None:
    pairs = [(u.meta.get("train_loss"), max(1, u.meta["num_samples"])) for u in batch]
    pairs = [(loss, n) for loss, n in pairs if loss is not None]
    if not pairs:
        return None
    return sum(loss * n for loss, n in pairs) / sum(n for _, n in pairs)
