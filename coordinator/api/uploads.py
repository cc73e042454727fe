"""Resumable pushes: a large update sent in chunks, so a broken connection costs one chunk, not the body.

    POST   /experts/<name>/uploads                    {"update": <UpdateMeta>, "size": N, "digest": "sha256=<hex>"}
                                                      -> 201 {"upload_id", "offset": 0, ...}; the same update_id
                                                      again -> 200 with the open upload and its offset
    PUT    /experts/<name>/uploads/<id>               one chunk, Content-Range: bytes <start>-<end>/<size>, start =
                                                      the offset -> 200 {"offset"} once the chunk is durable;
                                                      checked by X-FedMoE-Digest (the chunk's digest) and/or
                                                      X-FedMoE-Upload-Digest (the digest of bytes 0-<end>)
    GET    /experts/<name>/uploads/<id>  (and HEAD)   the offset (also in X-FedMoE-Upload-Offset)
    POST   /experts/<name>/uploads/<id>/complete      size and SHA-256 checked, then the one-shot push's own
                                                      path (Coordinator.submit_update): 202 recorded, 200 seen before
    DELETE /experts/<name>/uploads/<id>               abandon it

Everything a push checks is checked the same way (token, expert, metadata, size limit); finishing runs
the same code as a push, so a resumable push is applied exactly once by its update_id, like any push.
The routes serve whatever ``UploadTarget`` the app installs: the root's Coordinator (``RootTarget``) or a
relay (coordinator/relay/service.py), whose finished uploads are queued and pre-aggregated like its pushes.
Storage and bounds: coordinator/storage/upload_files.py. A chunk that overlaps the received bytes is a 409, one
after a gap or past the end a 416; either error's details carry the offset to continue from.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from flask import Blueprint, Flask, Response, current_app, g, jsonify, request
from werkzeug.exceptions import ClientDisconnected

from coordinator.api.requests import json_body
from coordinator.access.audit import rejection_event
from coordinator.storage.audit_log import Event
from coordinator.access.auth import acting_worker, check_may_carry_members, principal
from coordinator.config import CoordinatorConfig
from coordinator.cohorts import refuse_clear_push
from coordinator.http.wsgi import SPOOLED_BODY
from coordinator.service import Coordinator
from coordinator.access.tokens import RELAY, WORKER, Principal, relay_key
from coordinator.storage.upload_limits import UploadLimits
from coordinator.storage.upload_files import UploadStore
from coordinator.storage.upload_record import Upload
from protocol.errors import (BadRequest, Conflict, FedMoEError, InvalidUpdate, PayloadTooLarge, RequestTimeout,
                             Unavailable)
from protocol.integrity import DIGEST_HEADER, ClientReader, algorithm_of, hex_of, parse_digest
from protocol.schemas import API_PREFIX, UpdateMeta, check_name
from protocol.uploads import PREFIX_DIGEST_HEADER

OFFSET_HEADER = "X-FedMoE-Upload-Offset"
CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,18})-([0-9]{1,18})/([0-9]{1,18})")

bp = Blueprint("uploads", __name__, url_prefix=API_PREFIX)


class UploadTarget(Protocol):
    """What the upload routes need of the service a finished upload is pushed into."""

    @property
    def config(self) -> CoordinatorConfig: ...

    def check_upload(self, name: str, size: int) -> None:
        """Raise (NotFound, 507, ...) unless an update of ``size`` bytes for expert ``name`` could be taken now."""

    def recorded_update(self, update_id: str) -> tuple[str, str | None] | None:
        """(expert, body content id) of the update recorded under ``update_id``, or None."""

    def update_status(self, update_id: str) -> dict[str, Any]: ...

    def submit_upload(self, name: str, meta: UpdateMeta, part: Path, digest: str) -> tuple[dict[str, Any], bool]:
        """The one-shot push's path on the finished body at ``part`` (left in place), of content id ``digest``:
        (status, is_new), durable before it returns."""

    def record_event(self, event: Event) -> None: ...


@dataclass(frozen=True)
class RootTarget:
    """The root coordinator behind the upload routes: a finished upload is ``Coordinator.submit_update``."""

    coordinator: Coordinator

    @property
    def config(self) -> CoordinatorConfig:
        return self.coordinator.config

    def check_upload(self, name: str, size: int) -> None:
        self.coordinator.require_expert(name)

    def recorded_update(self, update_id: str) -> tuple[str, str | None] | None:
        known = self.coordinator.store.rows.update(update_id)
        return None if known is None else (known.expert, known.body_sha256)

    def update_status(self, update_id: str) -> dict[str, Any]:
        return self.coordinator.update_status(update_id)

    def submit_upload(self, name: str, meta: UpdateMeta, part: Path, digest: str) -> tuple[dict[str, Any], bool]:
        c = self.coordinator
        return c.submit_update(name, meta, c.store.bodies.link_received(part, digest))

    def record_event(self, event: Event) -> None:
        self.coordinator.record_event(event)


def uploads() -> UploadStore:
    return current_app.extensions["fedmoe_uploads"]


def target() -> UploadTarget:
    return current_app.extensions["fedmoe_upload_target"]


def install(app: Flask, service: Coordinator | UploadTarget) -> None:
    """Open the data dir's uploads and serve the routes into ``service`` (the root's Coordinator, or a relay).
    Bounds (coordinator/storage/upload_limits.py): ``--upload-idle-seconds``; Flask config (e.g. ``CoordinatorConfig.extra``)
    may set UPLOAD_IDLE_SECONDS, UPLOADS_PER_WORKER (per principal, 2), MAX_OPEN_UPLOADS (1000) and
    UPLOAD_PROTECTED_SECONDS (60)."""
    into = RootTarget(service) if isinstance(service, Coordinator) else service
    default = UploadLimits()
    limits = UploadLimits(
        idle_seconds=float(app.config.get("UPLOAD_IDLE_SECONDS", into.config.upload_idle_seconds)),
        per_owner=int(app.config.get("UPLOADS_PER_WORKER", default.per_owner)),
        max_open=int(app.config.get("MAX_OPEN_UPLOADS", default.max_open)),
        protected_seconds=float(app.config.get("UPLOAD_PROTECTED_SECONDS", default.protected_seconds)))
    app.extensions["fedmoe_uploads"] = UploadStore(into.config.data_dir / "uploads", limits)
    app.extensions["fedmoe_upload_target"] = into
    app.register_blueprint(bp)


def owner_of(caller: Principal) -> str | None:
    """Who owns the uploads ``caller`` opens, and may alone use them: a worker by its id, a relay by
    ``relay:<id>`` (never a worker id: ':' is not allowed in one); None for the admin, who may use any upload.
    A relay acts for many workers, but its uploads are its own, counted against its own limit."""
    if caller.role == WORKER:
        return caller.worker_id
    if caller.role == RELAY:
        return relay_key(caller.worker_id or "")
    return None


def _caller() -> str | None:
    return owner_of(principal())


def _answer(upload: Upload, status: int = 200, **extra: Any) -> tuple[Response, int]:
    response = jsonify(upload.status(uploads().limits.idle_seconds) | extra)
    response.headers[OFFSET_HEADER] = str(upload.offset)
    return response, status


@bp.post("/experts/<name>/uploads")
def open_upload(name: str) -> tuple[Response, int]:
    c = target()
    check_name(name, "expert name")
    body = json_body()
    update = body.get("update")
    if not isinstance(update, dict):
        raise BadRequest(f"'update' must be the update's metadata (an object, as in the push header), got {update!r}")
    meta = UpdateMeta.from_json(update)
    meta = replace(meta, worker_id=acting_worker(meta.worker_id, "worker_id in 'update'"))
    check_may_carry_members(meta)
    refuse_clear_push(meta)  # --secure-aggregation: updates come only masked, through cohorts
    size, digest = body.get("size"), body.get("digest")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise BadRequest(f"'size' must be the body's length in bytes (an integer >= 1), got {size!r}")
    if size > c.config.max_body_bytes:
        raise PayloadTooLarge(f"an upload of {size} bytes is over the limit of {c.config.max_body_bytes} bytes "
                              "(coordinator flag --max-body-mb)", limit=c.config.max_body_bytes)
    if not isinstance(digest, str):
        raise BadRequest(f"'digest' must be 'blake3=<64 hex digits>' or 'sha256=<64 hex digits>' of the whole body, got {digest!r}")
    digest = parse_digest(digest)
    c.check_upload(name, size)
    if (done := _recorded(c, name, meta, digest)) is not None:
        return jsonify({"update": done, "upload_id": None, "offset": size, "size": size, "complete": True}), 200
    upload, created = uploads().open(name, _caller(), meta, size, digest)
    response, status = _answer(upload, 201 if created else 200, chunk_limit=c.config.max_body_bytes,
                               prefix_digests=True)
    response.headers["Location"] = f"{API_PREFIX}/experts/{name}/uploads/{upload.upload_id}"
    return response, status


def _recorded(c: UploadTarget, name: str, meta: UpdateMeta, digest: str) -> dict[str, Any] | None:
    """The status of an update already recorded under this update_id (nothing left to send), else None."""
    known = c.recorded_update(meta.update_id)
    if known is None:
        return None
    expert, body_digest = known
    same_algorithm = body_digest is not None and algorithm_of(body_digest) == algorithm_of(digest)
    # (digests in different algorithms cannot be compared here: the push at finish checks the body itself)
    if expert != name or (same_algorithm and body_digest != digest):
        raise Conflict(f"update_id {meta.update_id!r} was already used for another expert or body; a new update "
                       "needs a new update_id", update_id=meta.update_id)
    return c.update_status(meta.update_id)


@bp.get("/experts/<name>/uploads/<upload_id>")
def upload_status(name: str, upload_id: str) -> tuple[Response, int]:
    return _answer(uploads().get(upload_id, name, _caller()))


@bp.put("/experts/<name>/uploads/<upload_id>")
def upload_chunk(name: str, upload_id: str) -> tuple[Response, int]:
    store = uploads()
    upload = store.get(upload_id, name, _caller())
    start, length = chunk_range(upload)
    header, prefix = request.headers.get(DIGEST_HEADER), request.headers.get(PREFIX_DIGEST_HEADER)
    try:
        store.write(upload, start, ClientReader(request.environ["wsgi.input"]), length,
                    parse_digest(header) if header is not None else None, request.environ.get(SPOOLED_BODY),
                    parse_digest(prefix) if prefix is not None else None)
    except ClientDisconnected:  # a read that failed: stalled past --socket-timeout, or gone
        raise RequestTimeout("the chunk stopped arriving before its Content-Length; ask for the offset and "
                             "send it again", offset=upload.offset) from None
    return _answer(upload)


def chunk_range(upload: Upload) -> tuple[int, int]:
    """(start, length) from Content-Range: bytes <start>-<end>/<size>, matched against Content-Length."""
    raw = request.headers.get("Content-Range")
    m = CONTENT_RANGE.fullmatch(raw.strip()) if raw else None
    if m is None:
        raise BadRequest(f"a chunk needs Content-Range: bytes <start>-<end>/<size>, got {raw!r}")
    start, end, total = (int(v) for v in m.groups())
    if total != upload.size:
        raise BadRequest(f"Content-Range says the upload is {total} bytes; it was opened as {upload.size}")
    if end < start:
        raise BadRequest(f"Content-Range {raw!r} ends before it starts")
    if request.content_length is None or request.content_length != end - start + 1:
        raise BadRequest(f"a chunk's Content-Length must be its range's length ({end - start + 1} bytes), got "
                         f"{request.content_length}")
    return start, end - start + 1


@bp.delete("/experts/<name>/uploads/<upload_id>")
def abandon_upload(name: str, upload_id: str) -> tuple[Response, int]:
    uploads().abandon(uploads().get(upload_id, name, _caller()))
    return Response(status=204), 204


@bp.post("/experts/<name>/uploads/<upload_id>/complete")
def complete_upload(name: str, upload_id: str) -> tuple[Response, int]:
    c, store = target(), uploads()
    upload = store.get(upload_id, name, _caller())
    with store.holding(upload):
        if upload.completed:  # a retried finish: the push's answer to a retry
            return jsonify(c.update_status(upload.meta.update_id)), 200
        if upload.offset != upload.size:
            raise Conflict(f"upload {upload_id} has {upload.offset} of its {upload.size} bytes; send the rest first",
                           reason="upload_incomplete", offset=upload.offset)
        try:
            status, is_new = _push(c, store, upload)
        except FedMoEError as exc:
            _audit(c, upload, exc)
            raise
    return jsonify(status), 202 if is_new else 200


def _push(c: UploadTarget, store: UploadStore, upload: Upload) -> tuple[dict[str, Any], bool]:
    """The one-shot push's path on the assembled body; the upload is dropped unless the refusal is temporary."""
    digest = store.received_digest(upload)
    if digest != upload.digest:
        store.discard(upload)
        raise InvalidUpdate(f"the {upload.size} bytes received have digest {hex_of(digest)[:16]}..., not the "
                            f"{hex_of(upload.digest)[:16]}... the upload was opened with; it was dropped: send the update "
                            "again", reason="digest_mismatch")
    try:
        result = c.submit_upload(upload.expert, upload.meta, store.part(upload), digest)
    except Unavailable:  # disk full (507) and the like: keep the bytes, finishing again may succeed
        raise
    except FedMoEError:
        store.discard(upload)
        raise
    store.mark_completed(upload)
    return result


def _audit(c: UploadTarget, upload: Upload, exc: FedMoEError) -> None:
    """Every refused push goes to the audit log, as api.push_update's do."""
    g.audited = True
    c.record_event(rejection_event(upload.expert, exc.status, exc.code, exc.message, exc.details,
                                   json.dumps(upload.meta.to_json()), None, request.remote_addr,
                                   caller=upload.owner if principal().role == WORKER else None))  # as a push's
