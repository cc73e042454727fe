"""A relay's HTTP API: the root's paths and token rules (``coordinator.access.auth.RULES``), served locally.

Workers cannot tell a relay from the root: they register (with the same join token), push, pull,
heartbeat and send profiles at the same paths. The blueprint is named ``api`` like the root's so
the same access rule applies to each endpoint; request bodies are received by the root's own
``receive_body`` (fsynced temp file, digest checked, size limit). Resumable uploads are the root's own
blueprint (coordinator/api/uploads.py) with the RelayService as its ``UploadTarget``: a finished upload is
queued by ``submit_update`` exactly like a one-shot push. Diff pulls (``?since=``) are the root's own view
(``coordinator.api.routes.weights_diff_response``) over the relay's cached versions (coordinator/relay/diffs.py).
"""
from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

from flask import Blueprint, Flask, Response, current_app, jsonify, request, send_file
from werkzeug.exceptions import HTTPException

from coordinator.api import routes as root_api
from coordinator import cohorts
from coordinator.api import uploads
from coordinator.access import auth
from coordinator.api.requests import json_body, receive_body
from coordinator.api.app import StrictJSONProvider, log_requests_at_debug, register_error_handlers
from coordinator.access.auth import acting_worker, check_may_carry_members
from coordinator.errors import REFUSALS, as_http_error
from coordinator.relay.relay_store_schema import CachedWeights
from coordinator.relay.dp_cohorts import SpentBudgets, upstream_booking
from coordinator.relay.config import RelayConfig
from coordinator.relay.service import RelayService
from coordinator.cohorts import refuse_clear_push
from coordinator.api.relays import probe_body, probe_upload
from protocol.errors import Conflict
from protocol.schemas import (API_PREFIX, EXPERT_HEADER, UPDATE_HEADER, VERSION_HEADER, WORKER_HEADER,
                              ExpertSpec, UpdateMeta, check_name, parse_header_json)

bp = Blueprint("api", __name__, url_prefix=API_PREFIX)


def relay() -> RelayService:
    return current_app.extensions["fedmoe"]


@bp.get("/health")
def health() -> Response:
    r = relay()
    return jsonify({"status": "ok", "role": "relay", "relay_id": r.relay_id, "upstream": r.upstream.base_url,
                    "upstream_reachable": r.forwarder.upstream_reachable, "experts": len(r.store.cached_experts())})


# Registration and heartbeats are the root's own views (coordinator/api/routes.py): they validate the body, check
# the caller's right to register and issue the worker token, then call ``register_worker`` / ``heartbeat``
# on ``app.extensions["fedmoe"]``, which here is the RelayService (same signatures, its own workers table).
bp.add_url_rule("/workers", "register_worker", root_api.register_worker, methods=["POST"])
bp.add_url_rule("/workers/<worker_id>/heartbeat", "heartbeat", root_api.heartbeat, methods=["POST"])


@bp.get("/workers")
def list_workers() -> Response:
    return jsonify({"workers": relay().list_workers()})


@bp.get("/experts")
def list_experts() -> Response:
    return jsonify({"experts": relay().list_experts()})


@bp.get("/experts/<name>")
def expert_info(name: str) -> Response:
    return jsonify(relay().expert_info(check_name(name, "expert name")))


@bp.put("/experts/<name>")
def create_expert(name: str) -> tuple[Response, int]:
    check_name(name, "expert name")
    spec = ExpertSpec.from_json(parse_header_json(request.headers.get(EXPERT_HEADER), EXPERT_HEADER))
    spec = replace(spec, worker_id=acting_worker(spec.worker_id, f"worker_id in {EXPERT_HEADER}"))
    info, status = relay().create_expert(name, spec, receive_body())
    return jsonify(info), status


@bp.get("/experts/<name>/weights")
def expert_weights(name: str) -> Response:
    """Full weights from the relay's cache (ETag, Range); ?since= diffs computed here from the versions it holds.

    ``?version=N`` is version N, as at the root: from the cache if the relay holds it, else fetched upstream
    for this request (the root's 404 if it does not keep N either); never another version's bytes."""
    r = relay()
    check_name(name, "expert name")  # it goes into the upstream URL and names a cache entry (audit)
    worker_id = acting_worker(request.headers.get(WORKER_HEADER), WORKER_HEADER)
    if "since" in request.args:  # the root's own view over the relay's versions: same parsing, answers, bytes
        return root_api.weights_diff_response(r, name, worker_id)
    version = root_api.int_arg("version")  # the root's parsing: its 400 for ?version=abc or -1
    for attempt in range(3):  # the cache may replace the blob between the lookup and the open
        if version is None:
            cached, source = _current_weights(r, name, worker_id)
        else:
            held = r.store.cached_version(name, version)
            if held is None:
                return _weights_from_upstream(r, name, version)
            cached, source = held, r.blobs.path(held.blob)
        try:
            response = send_file(io.BytesIO(source) if isinstance(source, bytes) else source,
                                 mimetype="application/octet-stream", etag=cached.etag,
                                 conditional=True, download_name=f"{name}-v{cached.version}.safetensors", max_age=0)
            break
        except FileNotFoundError:
            if attempt == 2:
                raise Conflict(f"expert {name!r} kept changing while its weights were opened; pull again") from None
    response.headers[VERSION_HEADER] = str(cached.version)
    if response.status_code in (200, 206):
        r.bytes_served += response.content_length or 0
    return response


def _current_weights(r: RelayService, name: str, worker_id: str | None) -> tuple[CachedWeights, Path | bytes]:
    """What a pull of the current weights is sent: the cached root version's file, or the site's weights."""
    if r.site is not None:
        return r.site.weights(name, worker_id)
    cached = r.cache.get(name)
    return cached, r.blobs.path(cached.blob)


def _weights_from_upstream(r: RelayService, name: str, version: int) -> Response:
    """Version ``version``, which this relay does not hold, fetched upstream and passed on (not kept: the cache
    holds the newest versions, the bases of diff pulls). A client's If-None-Match goes upstream with it (a 304
    costs no body over the long link); Range requests are answered here. Fetched bytes count as fetched."""
    body, etag = r.upstream.version_body(name, version, request.headers.get("If-None-Match"))
    if body is None:
        response = Response(status=304)
        if etag:
            response.set_etag(etag)
    else:
        r.cache.bytes_fetched += len(body)
        response = send_file(io.BytesIO(body), mimetype="application/octet-stream", etag=etag or False,
                             conditional=True, download_name=f"{name}-v{version}.safetensors", max_age=0)
    response.headers[VERSION_HEADER] = str(version)
    return response


@bp.post("/experts/<name>/updates")
def push_update(name: str) -> tuple[Response, int]:
    r = relay()
    check_name(name, "expert name")
    try:
        meta = UpdateMeta.from_json(parse_header_json(request.headers.get(UPDATE_HEADER), UPDATE_HEADER))
        meta = replace(meta, worker_id=acting_worker(meta.worker_id, f"worker_id in {UPDATE_HEADER}"))
        check_may_carry_members(meta)
        refuse_clear_push(meta)  # --secure-aggregation: updates come only masked, through cohorts
        if request.content_length is not None:
            r.room_for(request.content_length)  # 507 before reading a body we could not keep
        status, is_new = r.submit_update(name, meta, receive_body())
    except REFUSALS + (HTTPException,) as exc:  # every refused push goes to the audit log, as at the root
        root_api.record_rejection(r, name, exc if isinstance(exc, HTTPException) else as_http_error(exc))
        raise
    return jsonify(status), 202 if is_new else 200


@bp.get("/updates/<update_id>")
def update_status(update_id: str) -> Response:
    return jsonify(relay().update_status(update_id))


# The audit log is the root's view over the relay's own log (RelayService.events): refused pushes, accepted
# updates, and the updates the root refused after the relay had acknowledged them.
bp.add_url_rule("/events", "events", root_api.events, methods=["GET"])


@bp.put("/experts/<name>/profiles/<worker_id>")
def put_profile(name: str, worker_id: str) -> Response:
    check_name(name, "expert name")
    check_name(worker_id, "worker id")
    return jsonify(relay().upstream.passthrough("PUT", f"/experts/{name}/profiles/{worker_id}", json=json_body()))


@bp.post("/forward")
def forward_now() -> Response:
    """Admin: forward what is queued now, not at the next interval (e.g. draining before maintenance)."""
    r = relay()
    delivered = r.forwarder.flush()
    return jsonify({"delivered": delivered, "upstream_reachable": r.forwarder.upstream_reachable,
                    "queued_bytes": r.store.queued_bytes()})


bp.add_url_rule("/probe", "probe", probe_body, methods=["GET"])
bp.add_url_rule("/probe", "probe_upload", probe_upload, methods=["POST"])  # answered here: the link to measure


def create_relay_app(config: RelayConfig, port: int | None = None) -> Flask:
    """The relay's Flask app; ``app.extensions["fedmoe"].join_upstream()`` starts it forwarding."""
    app = Flask(__name__)
    app.json = StrictJSONProvider(app)
    app.config.update(MAX_CONTENT_LENGTH=config.coordinator.max_body_bytes, **dict(config.coordinator.extra))
    app.extensions["fedmoe"] = RelayService(config, port)
    app.register_blueprint(bp)
    uploads.install(app, app.extensions["fedmoe"])  # the root's resumable upload routes, finishing into the relay
    if config.coordinator.secagg is not None:  # the site's cohorts, unmasked here; only their sums go upstream
        service, budgets = app.extensions["fedmoe"], SpentBudgets()
        applier = cohorts.install(app, service, config.coordinator.secagg, config.coordinator.data_dir,
                                  booking=upstream_booking(service.upstream, budgets),  # under a DP root: booked
                                  budgets=budgets)  # there first; a join refused once the root said it is spent
        service.cohort_aggregator = applier.aggregator  # told the root's DP settings when it joins the root
        service.on_close.append(applier.close)
    log_requests_at_debug(app)
    auth.install(app, config.coordinator, app.extensions["fedmoe"].record_event)
    register_error_handlers(app)
    return app
