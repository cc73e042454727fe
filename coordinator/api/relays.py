"""The root's relay routes (coordinator/relay_registry.py keeps what they record) and the link probes.

    POST /api/v1/relays                 a relay registers (the relay join token) -> its relay-scoped token
    POST /api/v1/relays/<id>/report     each forward interval: its workers and byte counts
    POST /api/v1/experts/<name>/dp-cohorts   a relay books a DP cohort's step before unmasking it
    GET  /api/v1/relays                 the tree: relays, their workers, bytes saved (how workers find relays)
    GET  /api/v1/probe, POST /api/v1/probe   bytes to time a link with (root and relay alike)
"""
from __future__ import annotations

from flask import Blueprint, Flask, Response, current_app, jsonify, request

from coordinator.access.auth import authenticator, principal
from coordinator.access.tokens import ADMIN, RELAY, relay_key
from coordinator.api.requests import coordinator, json_body
from coordinator.checks.update_limits import UpdateLimits
from coordinator.relay_registry import MAX_REPORTED_WORKERS, REPORT_COUNTERS, RelayRegistry
from protocol.dp_cohort import DPCohortSum
from protocol.errors import BadRequest, Conflict, Forbidden, PayloadTooLarge
from protocol.probe import MAX_PROBE_BYTES
from protocol.schemas import API_PREFIX, BaseModelSpec, ExpertSpec, check_name, is_finite_number

bp = Blueprint("relays", __name__, url_prefix=API_PREFIX)


def registry() -> RelayRegistry:
    return current_app.extensions["fedmoe_relays"]


@bp.post("/relays")
def register_relay() -> tuple[Response, int]:
    body = json_body()
    relay_id = check_name(body.get("relay_id"), "relay_id")
    url = body.get("url")
    if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > 512):
        raise BadRequest(f"'url' must be an http(s) URL of at most 512 characters, got {url!r}")
    base = body.get("base_model")
    spec = None if base is None else BaseModelSpec.from_json(base)
    if spec is not None:
        for expert in coordinator().store.rows.experts():
            theirs = ExpertSpec.from_json(expert.spec).base_model
            if theirs.fingerprint != spec.fingerprint:
                raise Conflict(f"relay {relay_id!r} serves base model {spec.id!r} (fingerprint {spec.fingerprint[:12]}) "
                               f"but expert {expert.name!r} here was trained from {theirs.id!r} "
                               f"({theirs.fingerprint[:12]}); point the relay at a root of the same base model",
                               expert=expert.name)
    token: dict[str, object] = {}
    auth = authenticator()
    if auth is not None:
        token = auth.tokens.issue(relay_key(relay_id), "*", principal(), role=RELAY)
    registry().registered(relay_id, url, None if spec is None else {"id": spec.id, "fingerprint": spec.fingerprint})
    config = coordinator().config
    dp = config.dp
    limits = UpdateLimits(config.server_lr, config.norm_policy, dp=dp is not None,  # refused at the relay
                          secure_aggregation=config.secure_aggregation,  # with dp: the relay's cohorts are DP cohorts
                          noise_multiplier=None if dp is None else dp.noise_multiplier,
                          clip_norm=None if dp is None else dp.clip_norm).to_json()
    return jsonify({"relay_id": relay_id, "experts": coordinator().list_experts(), "limits": limits} | token), 200


@bp.post("/relays/<relay_id>/report")
def relay_report(relay_id: str) -> Response:
    caller = principal()
    if caller.role not in (ADMIN, RELAY):
        raise Forbidden("only a relay's token may report for it")
    body = json_body()
    workers = body.get("workers", [])
    if not isinstance(workers, list) or len(workers) > MAX_REPORTED_WORKERS:
        raise BadRequest(f"'workers' must be a list of at most {MAX_REPORTED_WORKERS} objects")
    clean = []
    for w in workers:
        if not isinstance(w, dict):
            raise BadRequest(f"each of 'workers' must be an object, got {w!r}")
        clean.append({"worker_id": check_name(w.get("worker_id"), "worker_id"),
                      "specialty": check_name(w.get("specialty"), "specialty"),
                      "status": str(w.get("status", "alive"))[:16]})
    stats = body.get("stats", {})
    if not isinstance(stats, dict):
        raise BadRequest("'stats' must be an object")
    counters = {}
    for key in REPORT_COUNTERS:
        value = stats.get(key, 0)
        if not is_finite_number(value) or value < 0:
            raise BadRequest(f"stats.{key} must be a non-negative number, got {value!r}")
        counters[key] = int(value)
    registry().report(check_name(relay_id, "relay_id"), clean, counters)
    return jsonify({"relay_id": relay_id, "status": "ok"})


@bp.post("/experts/<name>/dp-cohorts")
def book_dp_cohort(name: str) -> Response:
    """A relay books one of its DP cohorts' steps before it unmasks the cohort (coordinator/relay/dp_cohorts.py): 409
    (privacy_budget_spent, dp_cohort_mismatch, dp_relay_batch) if this root will not take the cohort's sum."""
    if principal().role not in (ADMIN, RELAY):
        raise Forbidden("only a relay's token may book a DP cohort")
    service = coordinator()
    service.require_expert(check_name(name, "expert name"))
    claim = DPCohortSum.from_json(json_body(), "a DP cohort")
    if service.config.dp is None or not service.config.secure_aggregation:
        raise Conflict("this coordinator does not run --dp-noise with --secure-aggregation, so it takes no DP "
                       "cohort's sum; restart the relay so that it learns the root's settings", reason="dp_relay_batch")
    service.privacy.book_relay_cohort(name, claim)
    return jsonify({"cohort": claim.cohort, "booked": True, "privacy": service.privacy.report(name)})


@bp.get("/relays")
def list_relays() -> Response:
    """The tree below this root: relays (with their URL, for workers to probe), their workers, bytes saved."""
    return jsonify({"relays": registry().tree()})


def probe_body() -> Response:
    """``?bytes=N`` zero bytes (at most protocol.probe.MAX_PROBE_BYTES): a client measures throughput."""
    raw = request.args.get("bytes", "65536")
    if not raw.isdigit() or not 0 <= int(raw) <= MAX_PROBE_BYTES:
        raise BadRequest(f"bytes must be an integer 0-{MAX_PROBE_BYTES}, got {raw!r}")
    response = Response(bytes(int(raw)), mimetype="application/octet-stream")
    response.headers["Cache-Control"] = "no-store"
    return response


def probe_upload() -> Response:
    """POST a body of at most protocol.probe.MAX_PROBE_BYTES, read and dropped: a worker times it to size its
    first ``--compression auto`` push from its upload link (worker.federation). Needs a token where auth is on."""
    if request.content_length is not None and request.content_length > MAX_PROBE_BYTES:
        raise PayloadTooLarge(f"a probe body may be at most {MAX_PROBE_BYTES} bytes, got {request.content_length}",
                              limit=MAX_PROBE_BYTES)
    received = 0
    while chunk := request.stream.read(1 << 20):
        received += len(chunk)
        if received > MAX_PROBE_BYTES:  # chunked bodies have no Content-Length: stop past the limit
            raise PayloadTooLarge(f"a probe body may be at most {MAX_PROBE_BYTES} bytes", limit=MAX_PROBE_BYTES)
    response = jsonify({"bytes": received})
    response.headers["Cache-Control"] = "no-store"
    return response


bp.add_url_rule("/probe", "probe", probe_body, methods=["GET"])
bp.add_url_rule("/probe", "probe_upload", probe_upload, methods=["POST"])


def install(app: Flask) -> None:
    app.extensions["fedmoe_relays"] = app.extensions["fedmoe"].relays  # the service's: aggregation counts relays
    app.register_blueprint(bp)
