"""Flask application factory."""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from flask import Flask, Response, g, has_request_context, jsonify, request, send_from_directory
from flask.json.provider import DefaultJSONProvider
from werkzeug.exceptions import HTTPException

from coordinator import cohorts
from coordinator.api import placement, relays, uploads
from coordinator.access import auth
from coordinator.api.routes import bp as api_bp
from coordinator.storage.blobs import is_storage_full
from coordinator.config import CoordinatorConfig
from coordinator.errors import DOMAIN_ROOTS, as_http_error
from coordinator.api.metrics import CoordinatorMetrics
from coordinator.service import Coordinator
from protocol.errors import FedMoEError, InsufficientStorage

log = logging.getLogger(__name__)
STATIC = Path(__file__).resolve().parent.parent / "static"


def create_app(config: CoordinatorConfig | None = None) -> Flask:
    """Build the coordinator app; its state lives in ``config.data_dir``."""
    config = config or CoordinatorConfig()
    app = Flask(__name__)
    app.json = StrictJSONProvider(app)
    app.config.update(MAX_CONTENT_LENGTH=config.max_body_bytes, **dict(config.extra))
    coordinator = Coordinator(config)
    app.extensions["fedmoe"] = coordinator
    app.register_blueprint(api_bp)
    uploads.install(app, coordinator)  # resumable pushes (coordinator/api/uploads.py)
    relays.install(app)  # relay coordinators below this root (coordinator/api/relays.py)
    placement.init_app(app)  # where each worker syncs, from the links they measure (coordinator.placement)
    if config.secagg is not None:  # --secure-aggregation: updates come only as cohorts' sums (coordinator.cohorts)
        coordinator.on_close.append(cohorts.install(app, coordinator, config.secagg, config.data_dir,
                                                    coordinator.privacy).close)
    log_requests_at_debug(app)  # before auth's hook, so refused requests are timed and logged too
    auth.install(app, config, coordinator.record_event)
    metrics = CoordinatorMetrics(coordinator)
    coordinator.on_aggregated = metrics.aggregation.observe
    metrics.install(app)
    app.add_url_rule("/", "dashboard", lambda: send_from_directory(STATIC, "dashboard.html", max_age=0))
    register_error_handlers(app)
    return app


def log_requests_at_debug(app: Flask) -> None:
    """One DEBUG line per request (run_coordinator.py --debug): method, path, status, caller, time taken."""
    @app.before_request
    def start_clock() -> None:
        g.started = time.perf_counter()

    @app.after_request
    def log_request(response: Response) -> Response:
        if log.isEnabledFor(logging.DEBUG):
            caller = g.get("principal") or g.get("caller")
            who = "-" if caller is None else caller.worker_id or caller.role
            log.debug("%s %s -> %d (%s, %.1f ms)", request.method, request.path, response.status_code, who,
                      1000 * (time.perf_counter() - g.get("started", time.perf_counter())))
        return response


class StrictJSONProvider(DefaultJSONProvider):
    """JSON bodies never hold NaN or Infinity (not JSON; most parsers refuse them): such values are
    sent as null, and a warning says which answer held one (it is a bug upstream to fix)."""

    def dumps(self, obj: Any, **kwargs: Any) -> str:
        try:
            return super().dumps(obj, allow_nan=False, **kwargs)
        except ValueError:
            log.warning("the answer to %s held NaN or Infinity; sent as null",
                        request.path if has_request_context() else "(no request)")
            return super().dumps(_finite(obj), allow_nan=False, **kwargs)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(FedMoEError)
    def domain_error(exc: FedMoEError) -> tuple[Response, int]:
        authenticator = app.extensions.get("fedmoe_auth")
        if authenticator is not None and exc.status in (401, 403):  # every refusal is audited, once
            authenticator.record_refusal(exc)
        response = jsonify(exc.to_json())
        if "retry_after" in exc.details:  # 503 while the first gateway builds
            response.headers["Retry-After"] = str(exc.details["retry_after"])
        return response, exc.status

    for root in DOMAIN_ROOTS:  # compression, gateway and router errors: coordinator.errors maps them
        app.register_error_handler(root, lambda exc: domain_error(as_http_error(exc)))

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> tuple[Response, int]:
        code = (exc.name or "error").lower().replace(" ", "_")
        response = jsonify({"error": {"code": code, "message": exc.description}})
        response.headers.extend((k, v) for k, v in exc.get_headers() if k.lower() != "content-type")  # Allow on 405
        return response, exc.code or 500

    @app.errorhandler(Exception)
    def unexpected(exc: Exception) -> tuple[Response, int]:
        if is_storage_full(exc):  # a write no route turned into InsufficientStorage itself
            log.error("disk full: %s", exc)
            return domain_error(InsufficientStorage("the coordinator's disk is full; free space in its --data-dir "
                                                    "and try again"))
        log.exception("unhandled error (a bug): %s", exc)
        return jsonify({"error": {"code": "internal", "message": "internal error; see the coordinator log"}}), 500
