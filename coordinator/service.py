"""The coordinator's domain logic, free of HTTP: experts, updates, aggregation.

Flow of a push: the body is already in a fsynced temp file (the API put it
there); we decode and check it, move it into the blob store, record it as
pending in SQLite (that commit is the point of no loss: only then is 202 sent),
then aggregate whatever the policy says is ready; the 202 waits for a group
commit (coordinator/storage/group_commit.py) that makes the blob and the row durable,
taken after the expert's lock is let go. Aggregation runs under a
per-expert lock, writes the new version's blob, then commits the version row
and marks the applied updates in one transaction. A restart re-runs
aggregation over the pending rows, so nothing acknowledged is lost and nothing
is applied twice.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


from coordinator.checks.adapters import check_full_weights, check_lora_adapter, checked_norm
from coordinator.aggregation import StateDict
from coordinator.access import audit
from coordinator.storage.audit_log import Event
from coordinator.storage.blobs import BlobStore
from coordinator.storage.body_spool import BodySpool
from coordinator.storage.backends.errors import BackendUnavailable
from coordinator.config import CoordinatorConfig
from coordinator.diffs import DiffCache
from coordinator.errors import REFUSALS
from coordinator.storage.expert_store import ExpertStore
from coordinator.gateway_builder import GatewayBuilder
from coordinator.storage.health import StoreHealth
from coordinator.liveness import liveness
from coordinator.checks.norm_check import judge_norm
from coordinator.privacy_ledger import PrivacyLedgers
from coordinator.recovery import recover
from coordinator.routing import ExpertRouting
from coordinator.steps import AggregationSteps
from coordinator.storage.manifest import RELAYED, ManifestStore, members_applied
from coordinator.storage.manifest_schema import ExpertRow, UpdateRow, parsed_manifest
from coordinator.checks.update_limits import NORM_SCALE
from coordinator.relay_registry import RelayRegistry
from protocol.errors import BadRequest, Conflict, InsufficientStorage, InvalidPayload, NotFound, PayloadTooLarge
from protocol.files import private_dir, private_file
from protocol.integrity import DEFAULT_ALGORITHM, DIGEST_HEADER, Readable, algorithm_of, hex_of
from protocol.schemas import BaseModelSpec, ExpertSpec, UpdateMeta, check_name
from protocol.tensors import load_file, manifest_to_json

log = logging.getLogger(__name__)


class Coordinator:
    """The service: what the API asks for, on top of an ``ExpertStore`` (blobs + manifest).

    Lock order (outermost first): ``store.expert_lock(name)`` -> the store's own locks. The
    gateway builder and the diff cache take theirs without holding an expert lock.
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        private_dir(config.data_dir)  # 0700: tokens, audit log and weights are the operator's only
        self.store = open_store(config)
        self.diffs = DiffCache(self.store)
        self.gateway = GatewayBuilder(self.store, config)
        self.routing = ExpertRouting(self.store, config.route_threshold)
        self.privacy = PrivacyLedgers(config.data_dir, config.dp)
        """Each expert's DP-FedAvg ledger (--dp-noise) and its workers' DP-SGD claims."""
        self.relays = RelayRegistry()
        """Relays below this root and their latest reports (soft state; coordinator/api/relays.py fills it)."""
        self.steps = AggregationSteps(self.store, config, self._stepped, ledgers=self.privacy,
                                      relay_sources=self.relays.sources_on)
        self.on_aggregated: Callable[[float], None] = lambda seconds: None
        """Called with the seconds each aggregation step took (metrics hook)."""
        self.on_close: list[Callable[[], None]] = []
        """Stopped before the store closes (e.g. the secure-aggregation applier, coordinator.cohorts)."""
        self.health = StoreHealth(self.store.rows.expert_count)
        """What /health answers, without waiting on a database that is held up (coordinator/storage/health.py)."""
        # finish what a crash interrupted; refuse to start on what this process cannot see (coordinator/recovery.py)
        recover(self.store, self.steps.run)
        self.gateway.start()

    def close(self) -> None:
        for stop in self.on_close:
            stop()
        self.gateway.close()
        self.store.close()

    def _stepped(self, seconds: float) -> None:
        """An aggregation step committed: count it, and mark the gateway out of date."""
        self.on_aggregated(seconds)
        self.gateway.notify()

    # request bodies -------------------------------------------------------------

    @property
    def spool_dir(self) -> Path:
        """Where request bodies may be spooled on their way in (a local directory)."""
        return self.store.bodies.dir

    def check_body_size(self, length: int | None) -> None:
        """413 if a body's announced size (Content-Length) is over --max-body-mb."""
        check_body_size(length, self.config.max_body_bytes)

    def receive_body(self, stream: Readable, length: int | None, expected_digest: str | None,
                     spooled: Any = None) -> Path:
        """A request body in a fsynced temp file: 413 past --max-body-mb, 400 if it does not match
        ``expected_digest`` (nothing is left behind). ``length`` (Content-Length): read exactly that.
        ``spooled``: the front's coordinator.storage.incoming.SpooledBody, taken over instead of copying ``stream``."""
        return receive_checked(self.store.bodies, stream, length, self.config.max_body_bytes, expected_digest, spooled)

    # experts ------------------------------------------------------------------

    def create_expert(self, name: str, spec: ExpertSpec, body: Path) -> tuple[dict[str, Any], bool]:
        """Create an expert from its first adapter; (info, created). Same spec again is a no-op."""
        check_name(name, "expert name")
        try:
            with self.store.expert_lock(name):
                existing = self.store.rows.expert(name)
                if existing is not None:
                    self._check_compatible(existing, spec)
                    return self.expert_info(name), False
                if spec.full is not None:
                    manifest = check_full_weights(body, spec.full)
                else:
                    assert spec.lora is not None  # an ExpertSpec has exactly one of full and lora
                    manifest = check_lora_adapter(_load_adapter(body), spec.lora)
                self.store.create_expert(name, spec.to_json(), manifest_to_json(manifest), body, events=(
                    audit.expert_created(name, spec.lora.rank if spec.lora else None, spec.base_model.id),))
        finally:
            self.store.bodies.forget(body)
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
        return self.store.require_expert(name)

    def expert_info(self, name: str) -> dict[str, Any]:
        return self._info(self.require_expert(name))

    def list_experts(self) -> list[dict[str, Any]]:
        return [self._info(e) for e in self.store.rows.experts()]

    def _info(self, e: ExpertRow) -> dict[str, Any]:
        info = {"name": e.name, "version": e.version, **e.spec, "updates_applied": e.updates_applied,
                "samples_seen": e.samples_seen, "last_train_loss": e.last_train_loss,
                "pending_updates": self.store.rows.pending_count(e.name),
                "created_at": e.created_at, "updated_at": e.updated_at}
        privacy = self.privacy.report(e.name)
        return info if privacy is None else {**info, "privacy": privacy}

    def weights_diff(self, name: str, since: int, codec: str, codec_config: dict[str, Any],
                     version: int | None = None) -> tuple[bytes, int]:
        """Version ``version`` (default: the current one) minus version ``since``, encoded with a codec:
        (payload, version)."""
        return self.diffs.get(name, since, codec, codec_config, version)

    def record_pull(self, worker_id: str | None, name: str, body_bytes: int) -> None:
        if worker_id:
            self.store.ledger.record_pull(worker_id, body_bytes, _fp32_bytes(self.manifest(name)))

    def manifest(self, name: str) -> list[tuple[str, tuple[int, ...]]]:
        return list(parsed_manifest(self.require_expert(name).manifest))

    # updates ------------------------------------------------------------------

    def submit_update(self, name: str, meta: UpdateMeta, body: Path) -> tuple[dict[str, Any], bool]:
        """Record and (policy permitting) apply an update; (status, is_new).

        A retry (same update_id, same bytes) is a no-op answered with the stored status; the same
        update_id with different bytes is a 409, never silently taken for the first one.
        """
        try:
            expert = self.require_expert(name)
            body_digest = self.store.bodies.digest_of(body)
            known = self.store.rows.update(meta.update_id)
            if known is not None:
                return self._seen_before(known, name, meta, body_digest, body), False
            if meta.base_version > expert.version:
                raise Conflict(f"base_version {meta.base_version} is ahead of expert {name!r}, "
                               f"which is at version {expert.version}")
            self._refuse_recorded_members(meta)  # before the body is decoded: a refused relay batch costs nothing
            self.privacy.admit_update(name, meta, self.config.secure_aggregation)
            manifest = list(parsed_manifest(expert.manifest))
            # int8 bodies are checked and measured from their codes (coordinator/checks/fused_check.py); others are
            # decoded tensor by tensor. Either way nothing decoded is kept while we wait for the expert's
            # lock: the step reads the body again when it is computed.
            norm = checked_norm(body, meta.codec, meta.codec_config, manifest)
            size = body.stat().st_size
            with self.store.expert_lock(name):
                known = self.store.rows.update(meta.update_id)  # a concurrent retry may have won
                if known is not None:
                    return self._seen_before(known, name, meta, body_digest, body), False
                self._refuse_recorded_members(meta)  # again under the lock: a direct push of a member may have won
                verdict = judge_norm(norm, self.store.rows.recent_norms(name, self.config.norm_history),
                                     self.config.norm_policy)  # InvalidUpdate (422) in reject mode
                stored = meta.to_json() | ({NORM_SCALE: verdict.scale} if verdict.clipped else {})
                step = self.steps.prepare(name, stored, body)  # InvalidUpdate (422) if not finite
                recorded = self.store.add_update(name, stored, body, body_digest, size, _fp32_bytes(manifest),
                                                 norm=verdict.accepted_norm,
                                                 events=audit.update_accepted(name, meta, verdict, size),
                                                 durable=False)  # synced below, with other pushes', after the lock
                step_failed = False
                try:
                    self.steps.run_locked(name, step)
                except REFUSALS as exc:  # recorded (durable) all the same, so not an error to the client
                    step_failed = True
                    level = logging.WARNING if isinstance(exc, InsufficientStorage) else logging.ERROR
                    log.log(level, "update %s of %s is recorded but not applied yet: %s", meta.update_id, name, exc)
        finally:
            self.store.bodies.forget(body)
        self.store.sync()  # group commit: durable (blob and row) before the 202
        if meta.privacy is not None:  # a --dp-sgd worker's own account of what its data has spent
            self.privacy.record_claim(name, meta.worker_id or meta.update_id, meta.privacy)
        if not step_failed and not self.store.rows.held_up():
            with contextlib.suppress(BackendUnavailable):
                return self.update_status(meta.update_id), True
        # Recorded and durable: a 202 whatever the database does now (a 503 would say "nothing was recorded"), with
        # the row as recorded, pending. Exact when its step failed (the newest update is in the last step); when the
        # database is held up and its status is not read back, a step may have applied it meanwhile.
        return _status(recorded, expert.version), True

    def _refuse_recorded_members(self, meta: UpdateMeta) -> None:
        """A relay batch naming an update recorded here is refused whole (409 members_applied) before its step is
        computed; the store checks again in the batch's transaction (a member recorded for another expert)."""
        if meta.members:
            seen = self.store.rows.recorded_ids(list(meta.members))
            if seen:
                raise members_applied(meta.update_id, seen)

    def _seen_before(self, known: UpdateRow, name: str, meta: UpdateMeta, body_digest: str,
                     body: Path) -> dict[str, Any]:
        if known.expert != name:
            raise Conflict(f"update_id {known.update_id!r} was already used for expert {known.expert!r}")
        if known.body_sha256 is not None and algorithm_of(known.body_sha256) != algorithm_of(body_digest):
            body_digest = self.store.bodies.digest_of(body, algorithm_of(known.body_sha256))  # sent before 0.7
        if known.body_sha256 is not None and known.body_sha256 != body_digest:
            raise Conflict(f"update_id {known.update_id!r} was already used for a different body; a retry "
                           "must resend the same bytes, and a new update needs a new update_id",
                           update_id=known.update_id)
        self.record_event(audit.update_duplicate(name, meta.worker_id, known.update_id, known.status))
        self.store.sync()  # the first push's row may still wait for its flush: answer 200 only once it is durable
        return self.update_status(known.update_id)

    def record_event(self, event: Event) -> None:
        """Add an event that records no other change; a failure to log is logged, never raised."""
        try:
            self.store.ledger.add_event(event)
        except BackendUnavailable:  # the backend's own log line already says what failed
            log.debug("could not record %s event: a backend is unavailable", event.kind)
        except Exception:  # noqa: BLE001 - the audit log must not turn the answer into a 5xx
            log.exception("could not record %s event", event.kind)

    def events(self, limit: int, after: int | None = None, expert: str | None = None,
               kind: str | None = None) -> list[dict[str, Any]]:
        return self.store.rows.events(limit, after, expert, kind)

    def update_status(self, update_id: str) -> dict[str, Any]:
        row = self.store.rows.update(update_id)
        if row is None:
            raise NotFound(f"no update with id {update_id!r}")
        expert = self.store.rows.expert(row.expert)  # None once an operator set the expert aside (--quarantine)
        if row.status == RELAYED:  # a worker update inside a relay's batch: it shares the batch's fate
            batch = self.store.rows.update(row.meta["relayed_in"]) or row
            return _status(batch, None if expert is None else expert.version) | {
                "update_id": update_id, "relayed_in": row.meta["relayed_in"]}
        return _status(row, None if expert is None else expert.version)

    # routing ------------------------------------------------------------------

    # workers ------------------------------------------------------------------

    def register_worker(self, worker_id: str, specialty: str, base_model: BaseModelSpec,
                        sync_interval: float | None = None) -> dict[str, Any]:
        check_name(worker_id, "worker_id")
        check_name(specialty, "specialty")
        expert = self.store.rows.expert(specialty)
        if expert is not None:
            stored = ExpertSpec.from_json(expert.spec).base_model
            if stored.fingerprint != base_model.fingerprint:
                raise Conflict(f"worker {worker_id!r} runs base model {base_model.id!r} (fingerprint "
                               f"{base_model.fingerprint[:12]}) but expert {specialty!r} was trained from "
                               f"{stored.id!r} ({stored.fingerprint[:12]}); use the same --base-model")
        self.store.ledger.upsert_worker(worker_id, specialty, {"id": base_model.id, "fingerprint": base_model.fingerprint},
                              sync_interval,
                              events=(audit.worker_registered(worker_id, specialty, base_model.id, sync_interval),))
        return {"worker_id": worker_id, "specialty": specialty,
                "expert": None if expert is None else self._info(expert)}

    def heartbeat(self, worker_id: str) -> None:
        if not self.store.ledger.touch_worker(worker_id):
            raise NotFound(f"no worker {worker_id!r}; register first (POST /api/v1/workers)")

    def list_workers(self) -> list[dict[str, Any]]:
        now = time.time()
        return [w | {"status": liveness(now - w["last_seen"], w["sync_interval"])} for w in self.store.rows.workers()]


def _status(row: UpdateRow, expert_version: int | None) -> dict[str, Any]:
    """An update's status as the API answers it."""
    return {"update_id": row.update_id, "expert": row.expert, "status": row.status,
            "applied_version": row.applied_version, "expert_version": expert_version}


def check_body_size(length: int | None, limit: int) -> None:
    if length is not None and length > limit:
        raise PayloadTooLarge(f"body of {length} bytes is over the limit of {limit} bytes "
                              "(coordinator flag --max-body-mb)", limit=limit)


def receive_checked(spool: BodySpool | BlobStore, stream: Readable, length: int | None, limit: int,
                    expected_digest: str | None, spooled: Any = None) -> Path:
    """A body in a fsynced temp file of ``spool``: 413 past ``limit``, 400 (nothing left) on a digest mismatch.
    ``spooled`` (the front's SpooledBody) is taken over when it fits and was hashed with the expected algorithm.
    Shared by the root and the relay (coordinator/relay/service.py)."""
    check_body_size(length, limit)
    algorithm = algorithm_of(expected_digest) if expected_digest else DEFAULT_ALGORITHM
    if spooled is not None and spooled.size <= limit and algorithm_of(spooled.digest) == algorithm:
        body = spool.take_spooled(spooled.path, spooled.digest)
        spooled.taken = True
    else:
        body = spool.receive(stream, limit, length, algorithm)
    if expected_digest is not None and (actual := spool.digest_of(body, algorithm)) != expected_digest:
        spool.forget(body)
        raise BadRequest(f"body does not match its {DIGEST_HEADER} ({algorithm} {hex_of(actual)[:16]}... "
                         f"!= {hex_of(expected_digest)[:16]}...); it was damaged on the way, send it again")
    return body


def open_store(config: CoordinatorConfig) -> ExpertStore:
    """SQLite + local files (the default), or PostgreSQL and/or S3 when --manifest / --blobs name them."""
    blobs: BlobStore
    if config.blobs:
        from coordinator.storage.backends.s3 import S3BlobStore  # boto3 only when asked for
        blobs = S3BlobStore(config.data_dir / "blobs", config.blobs)
    else:
        blobs = BlobStore(config.data_dir / "blobs")
    if config.manifest:
        from coordinator.storage.backends.postgres import ExpertLocks, PostgresManifestStore
        return ExpertStore(blobs, PostgresManifestStore(config.manifest), config.keep_versions,
                           locks=ExpertLocks(config.manifest))
    return ExpertStore(blobs, ManifestStore(private_file(config.data_dir / "manifest.sqlite"), group_commit=True),
                       config.keep_versions)


def _fp32_bytes(manifest: list[tuple[str, tuple[int, ...]]]) -> int:
    return 4 * sum(math.prod(shape) for _, shape in manifest)


def _load_adapter(body: Path) -> StateDict:
    try:
        return load_file(body)
    except InvalidPayload as exc:  # the temp file's name says nothing to the client
        raise InvalidPayload("the adapter is not a valid safetensors file: " + str(exc).split(": ", 1)[-1]) from None
