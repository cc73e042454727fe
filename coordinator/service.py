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

import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coordinator.adapters import (check_full_weights, check_lora_adapter, check_update, non_finite_tensor,
                                  stored_deltas)
from coordinator.aggregation import AGGREGATORS, AggregationParams, StateDict, Update, l2_norm, robust_aggregator
from coordinator import audit
from coordinator.audit import Event
from coordinator.blobs import BlobStore, is_storage_full, storage_errors
from coordinator.config import CoordinatorConfig
from coordinator.diffs import DiffCache
from coordinator.gateway_builder import GatewayBuilder
from coordinator.norm_check import NormVerdict, judge_norm
from coordinator.recovery import quarantine_updates, recover
from coordinator.store import ExpertRow, ManifestStore, StaleAggregation, UpdateRow
from gateway.router import ProfileError, combine_profiles, profile_from_json, profile_to_json
from gateway.router import route as route_prompt
from protocol.errors import (BadRequest, Conflict, FedMoEError, InsufficientStorage, InvalidPayload, InvalidUpdate,
                             NotFound)
from protocol.files import private_dir, private_file
from protocol.schemas import MAX_COUNT, BaseModelSpec, ExpertSpec, UpdateMeta, check_name
from protocol.tensors import load_file, manifest_from_json, manifest_to_json, save_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedStep:
    """An aggregation step computed (and checked finite) before its last update was recorded."""

    update_ids: list[str]
    base_version: int
    weights: StateDict
    updates: list[Update]


@dataclass(frozen=True)
class WeightsRef:
    path: Path
    version: int
    digest: str


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        private_dir(config.data_dir)  # 0700: tokens, audit log and weights are the operator's only
        self.blobs = BlobStore(config.data_dir / "blobs")
        self.db = ManifestStore(private_file(config.data_dir / "manifest.sqlite"))
        self.params = AggregationParams(config.server_lr, config.staleness_decay)
        self._aggregate_fn = AGGREGATORS[config.aggregation]
        if config.robust != "none":  # a robust combination of fedbuff's buffer (coordinator.aggregation.robust)
            self._aggregate_fn = robust_aggregator(config.robust, config.trim_fraction)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        # Blobs are shared by digest across experts: adopting one and recording its row must not
        # interleave with dropping "unreferenced" blobs, or a new row could point at a deleted file.
        self.blobs_guard = threading.RLock()
        self.diffs = DiffCache(self)
        self.gateway = GatewayBuilder(self)
        self.on_aggregated: Callable[[float], None] = lambda seconds: None
        """Called with the seconds each aggregation step took (metrics hook)."""
        self._remove_orphan_blobs()
        recover(self)  # finish what a crash interrupted; quarantine what can never be used
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
                if spec.full is not None:
                    manifest = check_full_weights(body, spec.full)
                else:
                    assert spec.lora is not None  # an ExpertSpec holds exactly one of lora and full
                    manifest = check_lora_adapter(_load_adapter(body), spec.lora)
                with self.blobs_guard, storage_errors(f"store expert {name!r}"):
                    digest = self.blobs.adopt(body)
                    try:
                        self.db.create_expert(name, spec.to_json(), manifest_to_json(manifest), digest, events=(
                            audit.expert_created(name, spec.lora.rank if spec.lora else None, spec.base_model.id),))
                    except BaseException:  # not recorded: the adopted blob must not stay behind
                        self.drop_unreferenced([digest])
                        raise
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
        """The current weights minus version ``since``, encoded with a codec: (payload, current version)."""
        return self.diffs.get(name, since, codec, codec_config)

    def record_pull(self, worker_id: str | None, name: str, body_bytes: int) -> None:
        if worker_id:
            raw = 4 * sum(math.prod(shape) for _, shape in self.manifest(name))
            try:
                self.db.record_pull(worker_id, body_bytes, raw)
            except sqlite3.Error as exc:  # a tally: a full disk must not fail the pull it counts
                if not is_storage_full(exc):
                    raise
                log.warning("disk full: pull by %s not counted", worker_id)

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
            # for the expert's lock, and read again from the body when its step is computed.
            norm = l2_norm(check_update(body, meta.codec, meta.codec_config, manifest))
            size = body.stat().st_size
            with self._lock(name):
                known = self.db.update(meta.update_id)  # a concurrent retry may have won
                if known is not None:
                    return self._seen_before(known, name, meta, body_digest), False
                verdict = judge_norm(norm, self.db.recent_norms(name, self.config.norm_history),
                                     self.config.norm_policy)  # InvalidUpdate (422) in reject mode
                stored = meta.to_json() | ({"norm_scale": verdict.scale} if verdict.clipped else {})
                step = self._step_completed_by(name, stored, body)  # InvalidUpdate (422) if not finite
                self._record_update(name, meta, verdict, stored, body, body_digest, size, _fp32_bytes(manifest))
                try:
                    self._aggregate_locked(name, step)
                except FedMoEError as exc:  # recorded (durable) all the same, so not an error to the client
                    level = logging.WARNING if isinstance(exc, InsufficientStorage) else logging.ERROR
                    log.log(level, "update %s of %s is recorded but not applied yet: %s", meta.update_id, name, exc)
        finally:
            self.blobs.forget(body)
        return self.update_status(meta.update_id), True

    def _record_update(self, name: str, meta: UpdateMeta, verdict: NormVerdict, stored: dict[str, Any], body: Path,
                       body_digest: str, size: int, raw_bytes: int) -> None:
        """The point of no loss: blob, then row. Disk full at either step is a 507 and leaves nothing."""
        with self.blobs_guard, storage_errors(f"record update {meta.update_id!r}"):
            digest = self.blobs.adopt(body, body_digest)
            try:
                self.db.add_update(name, stored, digest, size, raw_bytes, norm=verdict.accepted_norm,
                                   events=audit.update_accepted(name, meta, verdict, size))
            except BaseException:
                self.drop_unreferenced([digest])
                raise

    def _step_completed_by(self, name: str, stored: dict[str, Any], body: Path) -> PreparedStep | None:
        """The aggregation step this update would complete, computed before it is recorded.

        Its result must be finite: two finite pushes of 3e38 summed to +Inf in float32, and an
        expert that is Inf cannot be pulled, merged or trained. Refusing here (422) means nothing
        was recorded; the step is then committed as computed (not computed twice).
        """
        pending = self.db.pending_updates(name)
        if len(pending) != self.config.updates_per_step - 1:
            return None
        entries = [(u.meta, self.blobs.path(_payload(u))) for u in pending] + [(stored, body)]
        expert = self.require_expert(name)
        new, updates = self._candidate(expert, entries)
        bad = non_finite_tensor(new)
        if bad is not None:
            raise InvalidUpdate(f"applying update {stored['update_id']!r} would make tensor {bad!r} of expert "
                                f"{name!r} overflow to Inf/NaN (float32); it was not recorded. Check the worker's "
                                "training (learning rate, divergence) and send a smaller update",
                                reason="result_not_finite", tensor=bad)
        return PreparedStep([u.update_id for u in pending] + [stored["update_id"]], expert.version, new, updates)

    def _candidate(self, expert: ExpertRow, entries: list[tuple[dict[str, Any], Path]]) -> tuple[StateDict, list[Update]]:
        """The expert's next weights from updates given as (stored meta, payload path)."""
        manifest = manifest_from_json(expert.manifest)
        current = load_file(self.weights(expert.name).path)  # our own copy: the aggregator updates it in place
        updates = [Update(delta=self._deltas(meta, path, manifest), num_samples=meta["num_samples"],
                          staleness=max(0, expert.version - meta["base_version"])) for meta, path in entries]
        return self._aggregate_fn(current, updates, self.params), updates

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

    def aggregate(self, name: str) -> None:
        with self._lock(name):
            self._aggregate_locked(name)

    def _aggregate_locked(self, name: str, prepared: PreparedStep | None = None) -> None:
        pending = self.db.pending_updates(name)
        k = self.config.updates_per_step
        while len(pending) >= k:
            batch, pending = pending[:k], pending[k:]
            ready = prepared if prepared is not None and prepared.update_ids == [u.update_id for u in batch] else None
            prepared = None
            if not self._apply(name, batch, ready):
                return

    def _apply(self, name: str, batch: list[UpdateRow], prepared: PreparedStep | None = None) -> bool:
        """One aggregation step; False if another process sharing the data dir got there first."""
        started = time.perf_counter()
        expert = self.require_expert(name)
        if prepared is not None and prepared.base_version == expert.version:
            new, updates = prepared.weights, prepared.updates
        else:
            try:
                new, updates = self._candidate(expert, [(u.meta, self.blobs.path(_payload(u))) for u in batch])
            except (InvalidPayload, FileNotFoundError):  # raw payloads are opened here, others decoded
                if all((row := self.db.update(u.update_id)) is not None and row.status == "pending" for u in batch):
                    raise
                log.warning("dropped an aggregation step of %s: its updates were applied meanwhile", name)
                return False  # another process applied them and dropped their payloads
            bad = non_finite_tensor(new)
            if bad is not None:  # recorded before results were checked (an older version): never apply it
                quarantine_updates(self, name, batch, f"applying it makes tensor {bad!r} overflow to Inf/NaN")
                return False
        with storage_errors(f"write version {expert.version + 1} of {name!r}"):
            written = self.blobs.write_temp(lambda p: save_file(new, p))
        loss = _mean_loss(batch)
        with self.blobs_guard, storage_errors(f"record version {expert.version + 1} of {name!r}"):
            digest = self.blobs.adopt(written)
            try:
                self.db.commit_version(name, expert.version + 1, digest, batch, loss, events=(audit.version_applied(
                    name, expert.version + 1, [u.update_id for u in batch], [u.staleness for u in updates], loss),))
            except StaleAggregation as exc:
                log.warning("dropped an aggregation step of %s: %s", name, exc)
                self.drop_unreferenced([digest])
                return False
            except BaseException:
                self.drop_unreferenced([digest])
                raise
        self.drop_unreferenced([u.blob for u in batch if u.blob]
                                + self.db.prune_versions(name, self.config.keep_versions))
        self.on_aggregated(time.perf_counter() - started)
        self.gateway.notify()
        log.info("expert %s -> version %d (%d update(s), staleness %s)", name, expert.version + 1,
                 len(batch), [u.staleness for u in updates])
        return True

    def _deltas(self, meta: dict[str, Any], path: Path,
                manifest: list[tuple[str, tuple[int, ...]]]) -> Mapping[str, torch.Tensor]:
        """Deltas read from the update's payload when aggregated (not kept in memory while pending)."""
        deltas = stored_deltas(path, meta["codec"], meta["codec_config"], manifest)
        scale = meta.get("norm_scale", 1.0)  # clipped at receipt (--norm-check clip)
        return deltas if scale == 1.0 else {k: t * scale for k, t in deltas.items()}

    def drop_unreferenced(self, digests: list[str]) -> None:
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

    def profiles(self) -> dict[str, Any]:
        """Every expert's combined routing profile (wire form) and the threshold, for routing elsewhere."""
        stored = self.db.profiles()
        profiles = {name: profile_to_json(combine_profiles([(np.frombuffer(v, dtype="<f4"), n) for v, n in rows]),
                                          sum(n for _, n in rows)) for name, rows in stored.items()}
        return {"threshold": self.config.route_threshold, "profiles": profiles}

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
    total = sum(n for _, n in pairs)
    # loss x n overflowed for a finite loss near 1e308 (an Inf in JSON); weights of at most 1 cannot
    return math.fsum(loss * (n / total) for loss, n in pairs)


def _load_adapter(body: Path) -> StateDict:
    try:
        return load_file(body)
    except InvalidPayload as exc:  # the temp file's name says nothing to the client
        raise InvalidPayload("the adapter is not a valid safetensors file: " + str(exc).split(": ", 1)[-1]) from None


def _payload(row: UpdateRow) -> str:
    """The blob of a pending update's payload (a row loses it only once applied)."""
    assert row.blob is not None, row.update_id
    return row.blob
