"""HTTP API v1: a thin mapping from requests to ``Coordinator`` calls.

Bodies that carry tensors are streamed to a fsynced temp file first (never
held whole in memory, never unpickled); JSON metadata rides in one header.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace

from flask import Blueprint, Response, g, jsonify, request, send_file
from werkzeug.exceptions import HTTPException
from werkzeug.exceptions import NotFound as NoRoute

from coordinator.access.audit import rejection_event
from coordinator.cohorts import refuse_clear_push
from coordinator.access.auth import (acting_worker, authenticator, check_may_carry_members, check_may_register,
                                     issue_token, principal)
from coordinator.errors import REFUSALS, as_http_error
from coordinator.storage.expert_store import WeightsRef
from coordinator.api.requests import PROMPT_BODY_LIMIT, WorkerFacing, coordinator, json_body, receive_body, service
from coordinator.api.openapi import OPENAPI
from coordinator.service import Coordinator
from coordinator.access.tokens import WORKER
from gateway.files import npz_bytes
from protocol.errors import BadRequest, Conflict, FedMoEError, Unavailable
from protocol.schemas import (API_PREFIX, EXPERT_HEADER, REDIRECT_HEADER, UPDATE_HEADER, VERSION_HEADER, WORKER_HEADER,
                              BaseModelSpec, ExpertSpec, UpdateMeta, check_name, is_finite_number, loads_json,
                              parse_header_json)
from protocol.tensors import StateDict, load_file, loads

bp = Blueprint("api", __name__, url_prefix=API_PREFIX)


@bp.get("/health")
def health() -> Response:
    """Up, with the expert count; never waits on the database for more than half a second (coordinator/storage/health.py)."""
    return jsonify({"status": "ok", **coordinator().health.snapshot()})


@bp.post("/workers")
def register_worker() -> tuple[Response, int]:
    body = json_body()
    worker_id = check_name(body.get("worker_id"), "worker_id")
    specialty = check_name(body.get("specialty"), "specialty")
    interval = body.get("sync_interval")
    if interval is not None and (not is_finite_number(interval) or interval <= 0):
        raise BadRequest(f"'sync_interval' must be a positive number of seconds, got {interval!r}")
    check_may_register(worker_id, specialty)  # before anything is recorded
    info = service().register_worker(worker_id, specialty, BaseModelSpec.from_json(body.get("base_model")),
                                     interval)
    return jsonify(info | issue_token(worker_id, specialty)), 200


@bp.post("/workers/<worker_id>/heartbeat")
def heartbeat(worker_id: str) -> Response:
    service().heartbeat(worker_id)
    return jsonify({"worker_id": worker_id, "status": "ok"})


@bp.delete("/workers/<worker_id>")
def revoke_worker(worker_id: str) -> Response:
    """Revoke a worker's tokens; it cannot register again under this id. There are none with auth off."""
    auth = authenticator()
    if auth is None:
        raise NoRoute()
    known = any(w["worker_id"] == worker_id for w in coordinator().list_workers())
    return jsonify(auth.tokens.revoke(worker_id, known))


@bp.get("/workers")
def list_workers() -> Response:
    auth = authenticator()
    revoked = auth.tokens.revoked_workers() if auth else set()
    return jsonify({"workers": [w | {"revoked": w["worker_id"] in revoked} for w in coordinator().list_workers()]})


@bp.get("/experts")
def list_experts() -> Response:
    return jsonify({"experts": coordinator().list_experts()})


@bp.put("/experts/<name>")
def create_expert(name: str) -> tuple[Response, int]:
    check_name(name, "expert name")
    spec = ExpertSpec.from_json(parse_header_json(request.headers.get(EXPERT_HEADER), EXPERT_HEADER))
    spec = replace(spec, worker_id=acting_worker(spec.worker_id, f"worker_id in {EXPERT_HEADER}"))
    info, created = coordinator().create_expert(name, spec, receive_body())
    return jsonify(info), 201 if created else 200


@bp.get("/experts/<name>")
def expert_info(name: str) -> Response:
    c = coordinator()
    return jsonify(c.expert_info(name) | {"versions": c.store.rows.versions(name)})


@bp.get("/experts/<name>/weights")
def expert_weights(name: str) -> Response:
    """Full weights (safetensors, ETag), or with ?since=V&codec=C the compressed difference from V."""
    c = coordinator()
    worker_id = acting_worker(request.headers.get(WORKER_HEADER), WORKER_HEADER)
    if "since" in request.args:
        return weights_diff_response(c, name, worker_id)
    for attempt in range(3):  # a version pruned between the lookup and the open is looked up again
        ref = c.store.weights(name, int_arg("version"))
        if (redirect := _presigned_redirect(c, ref, worker_id, name)) is not None:
            return redirect
        try:
            response = _send_blob(c, ref.digest, f"{name}-v{ref.version}.safetensors")
            break
        except FileNotFoundError:
            if attempt == 2:
                raise Conflict(f"expert {name!r} kept changing while its weights were opened; pull again") from None
    response.headers[VERSION_HEADER] = str(ref.version)
    if response.status_code in (200, 206):  # send_file honours Range + If-Range (a resumed pull gets a 206)
        c.record_pull(worker_id, name, response.content_length or 0)
    return response


def _presigned_redirect(c: Coordinator, ref: WeightsRef, worker_id: str | None, name: str) -> Response | None:
    """307 to a short-lived object-store URL (--blobs s3://, large weights, a client that says it follows
    it), so the bytes flow from the store, not through us. Conditional and Range requests stay here."""
    if request.headers.get(REDIRECT_HEADER) != "1" or "Range" in request.headers or \
            ('"' + ref.digest + '"') in request.headers.get("If-None-Match", ""):
        return None
    found = c.store.redirect_url(ref.digest, int(c.config.redirect_pulls_mb * (1 << 20)))
    if found is None:
        return None
    url, size = found
    response = Response(status=307, headers={"Location": url, "ETag": f'"{ref.digest}"', "Cache-Control": "no-store",
                                             VERSION_HEADER: str(ref.version)})
    c.record_pull(worker_id, name, size)
    return response


def weights_diff_response(c: WorkerFacing, name: str, worker_id: str | None) -> Response:
    since = int_arg("since")
    assert since is not None  # the route calls this only with ?since=
    codec = request.args.get("codec", "fp16")
    config = loads_json(request.args.get("codec_config", "{}"), "codec_config")
    if not isinstance(config, dict):
        raise BadRequest(f"codec_config must be a JSON object, got {config!r}")
    payload, version = c.weights_diff(name, since, codec, config, int_arg("version"))  # ?version=: to that one
    response = Response(payload, status=200 if payload else 304, mimetype="application/octet-stream")
    response.headers[VERSION_HEADER] = str(version)
    if payload:
        c.record_pull(worker_id, name, len(payload))
    return response


def int_arg(key: str) -> int | None:
    value = request.args.get(key)
    if value is None:
        return None
    if not re.fullmatch(r"[0-9]{1,18}", value):  # ASCII digits only, and within SQLite's 64-bit integers
        raise BadRequest(f"{key} must be a non-negative integer below 10**18, got {value!r}")
    return int(value)


@bp.post("/experts/<name>/updates")
def push_update(name: str) -> tuple[Response, int]:
    c = coordinator()
    try:
        meta = UpdateMeta.from_json(parse_header_json(request.headers.get(UPDATE_HEADER), UPDATE_HEADER))
        meta = replace(meta, worker_id=acting_worker(meta.worker_id, f"worker_id in {UPDATE_HEADER}"))
        check_may_carry_members(meta)
        refuse_clear_push(meta)  # --secure-aggregation: a worker's update comes only masked, through its cohort
        c.require_expert(name)  # 404 before reading a body we would throw away
        status, is_new = c.submit_update(name, meta, receive_body())
    except REFUSALS + (HTTPException,) as exc:  # every refused push goes to the audit log
        record_rejection(c, name, exc if isinstance(exc, HTTPException) else as_http_error(exc))
        raise
    return jsonify(status), 202 if is_new else 200


def record_rejection(c: WorkerFacing, name: str, exc: FedMoEError | HTTPException) -> None:
    if isinstance(exc, FedMoEError):
        status, code, message, details = exc.status, exc.code, exc.message, exc.details
    else:  # werkzeug's own refusals, e.g. a body over MAX_CONTENT_LENGTH
        status, code, message, details = exc.code or 400, str(exc.name).lower().replace(" ", "_"), \
            str(exc.description), {}
    caller = principal()
    g.audited = True  # the refusal is this row; the app's error handler must not add another
    c.record_event(rejection_event(name, status, code, message, details, request.headers.get(UPDATE_HEADER),
                                   request.headers.get(WORKER_HEADER), request.remote_addr,
                                   caller=caller.worker_id if caller.role == WORKER else None))


@bp.get("/events")
def events() -> Response:
    """The audit log, newest first: ?limit=1..500 (50), ?after=ID, ?expert=NAME, ?kind=KIND."""
    limit = int_arg("limit")
    limit = 50 if limit is None else limit
    if not 1 <= limit <= 500:
        raise BadRequest(f"limit must be 1-500, got {limit}")
    after = int_arg("after")
    if after is not None and after >= 2 ** 63:
        raise BadRequest(f"after must be below 2**63, got {after}")
    return jsonify({"events": service().events(limit, after, request.args.get("expert"), request.args.get("kind"))})


@bp.get("/updates/<update_id>")
def update_status(update_id: str) -> Response:
    return jsonify(coordinator().update_status(update_id))


@bp.put("/experts/<name>/profiles/<worker_id>")
def put_profile(name: str, worker_id: str) -> Response:
    return jsonify(coordinator().routing.put_profile(name, worker_id, json_body()))


@bp.get("/profiles")
def profiles() -> Response:
    """Combined routing profiles of every expert, so a server can route prompts locally (serving/)."""
    return jsonify(coordinator().routing.profiles())


@bp.post("/route")
def route() -> Response:
    body = json_body(PROMPT_BODY_LIMIT)
    prompt, threshold, expected = body.get("prompt"), body.get("threshold"), body.get("expected")
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest(f"'prompt' must be a non-empty string, got {prompt!r}")
    if threshold is not None and (not is_finite_number(threshold) or not 0 <= threshold <= 1):
        raise BadRequest(f"'threshold' must be a number in [0, 1], got {threshold!r}")
    if expected is not None and not isinstance(expected, str):
        raise BadRequest(f"'expected' must be an expert's name, got {expected!r}")
    result = coordinator().routing.route(prompt, threshold, expected)
    g.route_outcome = (expected or "", result.get("outcome") or ("expert" if result["expert"] else "fallback"))
    return jsonify(result)


@bp.get("/gateway")
def gateway_info() -> Response:
    info = coordinator().gateway.current(fresh=_fresh())
    return jsonify({k: v for k, v in info.items() if k != "blob"} | {"digest": info["blob"]})


@bp.get("/gateway/weights")
def gateway_weights() -> Response:
    fmt = request.args.get("format", "safetensors")
    if fmt not in ("safetensors", "npz"):
        raise BadRequest(f"format must be 'npz' or 'safetensors', got {fmt!r}")
    c, fresh = coordinator(), _fresh()
    for attempt in range(3):  # a build may prune the gateway just looked up: look it up again
        info = c.gateway.current(fresh=fresh)
        try:
            if fmt == "safetensors":
                response = _send_blob(c, info["blob"], "gateway.safetensors")
            else:
                public = {k: v for k, v in info.items() if k != "blob"}
                response = Response(npz_bytes(_blob_tensors(c, info["blob"]), public),
                                    mimetype="application/octet-stream")
                response.headers["Content-Disposition"] = "attachment; filename=gateway.npz"
            break
        except FileNotFoundError:
            if attempt == 2:
                raise Unavailable("the gateway was replaced while being read; retry", retry_after=1) from None
    response.headers[VERSION_HEADER] = str(info["version"])
    response.headers["X-FedMoE-Gateway"] = json.dumps({"version": info["version"], "sources": info["sources"]})
    return response


def _fresh() -> bool:
    """?fresh=1: the caller wants the gateway of the experts as they are now, not the newest built."""
    value = request.args.get("fresh", "0")
    if value not in ("0", "1"):
        raise BadRequest(f"fresh must be 0 or 1, got {value!r}")
    return value == "1"


def _send_blob(c: Coordinator, digest: str, download_name: str) -> Response:
    """A stored blob as the response body, ETag its digest; Range and If-None-Match honoured.

    A local file goes by path (send_file then knows its size and can use sendfile); FileNotFoundError
    if the blob was pruned meanwhile.
    """
    path = c.store.blobs.local_path(digest)
    return send_file(path if path is not None else c.store.blobs.open(digest), mimetype="application/octet-stream",
                     etag=digest, conditional=True, download_name=download_name, max_age=0)


def _blob_tensors(c: Coordinator, digest: str) -> StateDict:
    """A stored blob's tensors (memory-mapped when local); FileNotFoundError if it was pruned meanwhile."""
    path = c.store.blobs.local_path(digest)
    if path is not None:
        return load_file(path)
    with c.store.blobs.open(digest) as f:
        return loads(f.read())


@bp.get("/openapi.json")
def openapi() -> Response:
    """This API's OpenAPI 3 description (coordinator/api/openapi.py)."""
    return jsonify(OPENAPI)
