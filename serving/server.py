"""Start serving: load the base model once, every adapter, then answer HTTP in one process.

Server choice (docs/serving.md): the coordinator's buffering front (coordinator/http/serve.py), in this one process.
The model, the generation thread and the federation poller must live in the process that answers, loaded once:
gunicorn forks its workers (a worker loading a model for minutes is killed by the arbiter's timeout; a model loaded
before the fork runs torch in a forked child) and would load one copy per worker. werkzeug's threaded server, used
until issue 30, reads each request on a thread of its own: 16 clients dripping their heads held 16 threads. The front
reads heads and bodies on its event loop and gives a request thread only a complete request; a server-sent event
stream is written chunk by chunk as the application yields it, a thread pulling the next token while the loop writes.
"""
from __future__ import annotations

import logging
import signal
import sys
from dataclasses import dataclass

from flask import Flask

from coordinator.http.flask_admission import FlaskAdmission
from coordinator.http.options import FrontOptions
from coordinator.http.serve import ServerStartError, bind
from coordinator.http.serve import serve as serve_http
from protocol.client import CoordinatorClient
from serving.adapters import AdapterRegistry
from serving.app import check_head, create_app
from serving.auth import ApiKeys
from serving.config import ServeOptions
from serving.engine import GenerationEngine
from serving.federation import FederationFollower
from serving.routing import LocalRouter
from serving.service import ServingService

log = logging.getLogger(__name__)


@dataclass
class Server:
    """Everything a running server holds; ``close`` stops the threads."""

    service: ServingService
    follower: FederationFollower
    keys: ApiKeys | None

    def close(self) -> None:
        self.follower.stop()
        self.service.engine.stop()


def build(client: CoordinatorClient, options: ServeOptions) -> Server:
    """Load the base model and every adapter the coordinator has; start the engine and the poller."""
    from models.loading import ModelLoadError, load_base_model

    keys = ApiKeys.from_file(options.api_key_file) if options.api_key_file else None
    spec = options.base_model or _experts_base_model(client)
    try:
        base = load_base_model(spec, use_huggingface=options.use_huggingface)
    except ModelLoadError as exc:
        raise ValueError(f"{exc} (or pass --base-model)") from None
    registry, router = AdapterRegistry(), LocalRouter(options.route_threshold)
    engine = GenerationEngine(base.model, base.tokenizer, registry, options.engine, options.limits.max_queue)
    follower = FederationFollower(client, engine, router, base.fingerprint, options.poll_interval)
    loaded = follower.sync()  # before the engine thread starts: installs run right here
    log.info("loaded %s", ", ".join(loaded) or "no adapter yet (waiting for the federation)")
    context = int(getattr(base.model.config, "max_position_embeddings", 2048) or 2048)
    service = ServingService(engine, registry, router, options.limits, spec, context, follower.state)
    engine.start()
    follower.start()
    return Server(service, follower, keys)


def _experts_base_model(client: CoordinatorClient) -> str:
    for info in client.experts.list():
        if info.get("lora") and info.get("base_model", {}).get("id"):
            return info["base_model"]["id"]
    raise ValueError("the coordinator has no LoRA expert yet, so the base model is unknown; "
                     "pass --base-model (e.g. tiny-qwen2) or start a worker first")


def front_options(app: Flask, options: ServeOptions) -> FrontOptions:
    """The front's settings for serve.py: a request thread for every request that may wait for the model at once
    (the queue, the batch being generated) and a few for /health and /v1/models besides; a body over the limit, or
    without a valid key, refused from its head in the app's own (OpenAI) words."""
    return FrontOptions(threads=options.limits.max_queue + options.engine.max_batch + 4,
                        socket_timeout=options.socket_timeout, max_body=options.limits.max_body_bytes,
                        max_body_flag="serve.py flag --max-body-bytes", admission=FlaskAdmission(app, check_head))


def serve(client: CoordinatorClient, options: ServeOptions) -> None:
    """Bind first (a port in use fails before minutes of loading), load, then answer until SIGTERM/Ctrl-C."""
    try:
        sock = bind(options.host, options.port, backlog=128)
    except ServerStartError as exc:
        raise ValueError(str(exc)) from None
    server = build(client, options)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    host, port = sock.getsockname()[:2]
    log.info("FedMoE serving listening on http://%s:%d (base model %s, %s)", host, port,
             server.service.base_model_id, "API keys from " + str(options.api_key_file)
             if options.api_key_file else "no authentication")
    app = create_app(server.service, server.keys)
    try:
        serve_http(app, sock, front_options(app, options))
    finally:
        server.close()
