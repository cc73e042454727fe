"""Flask application factory."""
from __future__ import annotations

import logging
from pathlib import Path

from flask import Flask, Response, jsonify, send_from_directory
from werkzeug.exceptions import HTTPException

from coordinator import auth
from coordinator.api import bp as api_bp
from coordinator.config import CoordinatorConfig
from coordinator.metrics import CoordinatorMetrics
from coordinator.service import Coordinator
from protocol.errors import FedMoEError

log = logging.getLogger(__name__)
STATIC = Path(__file__).resolve().parent / "static"


def create_app(config: CoordinatorConfig | None = None) -> Flask:
    """Build the coordinator app; its state lives in ``config.data_dir``."""
    config = config or CoordinatorConfig()
    app = Flask(__name__)
    app.config.update(MAX_CONTENT_LENGTH=config.max_body_bytes, **dict(config.extra))
    coordinator = Coordinator(config)
    app.extensions["fedmoe"] = coordinator
    app.register_blueprint(api_bp)
    auth.install(app, config)
    metrics = CoordinatorMetrics(coordinator)
    coordinator.on_aggregated = metrics.aggregation.observe
    metrics.install(app)
    app.add_url_rule("/", "dashboard", lambda: send_from_directory(STATIC, "dashboard.html", max_age=0))
    _register_error_handlers(app)
    return app


def _register_error_handlers(app: Flask) -> None:
    @app.errorhandler(FedMoEError)
    def domain_error(exc: FedMoEError) -> tuple[Response, int]:
        response = jsonify(exc.to_json())
        if "retry_after" in exc.details:  # 503 while the first gateway builds
            response.headers["Retry-After"] = str(exc.details["retry_after"])
        return response, exc.status

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> tuple[Response, int]:
        code = (exc.name or "error").lower().replace(" ", "_")
        response = jsonify({"error": {"code": code, "message": exc.description}})
        response.headers.extend((k, v) for k, v in exc.get_headers() if k.lower() != "content-type")  # Allow on 405
        return response, exc.code or 500

    @app.errorhandler(Exception)
    def unexpected(exc: Exception) -> tuple[Response, int]:
        log.exception("unhandled error (a bug): %s", exc)
        return jsonify({"error": {"code": "internal", "message": "internal error; see the coordinator log"}}), 500
