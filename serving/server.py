"""Start serving: load the base model once, every adapter, then answer HTTP in one process.

Server choice (docs/serving.md): werkzeug's threaded WSGI server in this one process, not
gunicorn. The model, the generation thread and the federation poller must live in the process
that answers, loaded once: gunicorn forks its workers (a worker loading a model for minutes is
killed by the arbiter's timeout; a model loaded before the fork runs torch in a forked child) and
would load one copy per worker. Threads only wait here (generation is serialised on the engine
thread), and werkzeug writes and flushes each server-sent event as it is yielded. Connections
that stall get dropped by a socket timeout.
"""
from __future__ import annotations

import logging
import signal
import socket
import sys
from dataclasses import dataclass

from werkzeug.serving import WSGIRequestHandler, make_server

from protocol.client import CoordinatorClient
from serving.adapters import AdapterRegistry
from serving.app import create_app
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
    from worker.models import ModelLoadError, load_base_model

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
    for info in client.list_experts():
        if info.get("lora") and info.get("base_model", {}).get("id"):
            return info["base_model"]["id"]
    raise ValueError("the coordinator has no LoRA expert yet, so the base model is unknown; "
                     "pass --base-model (e.g. tiny-qwen2) or start a worker first")


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port") from None
    sock.listen(128)
    return sock


def serve(client: CoordinatorClient, options: ServeOptions) -> None:
    """Bind first (a port in use fails before minutes of loading), load, then answer until SIGTERM/Ctrl-C."""
    sock = bind(options.host, options.port)
    server = build(client, options)
    handler = type("Handler", (WSGIRequestHandler,), {"timeout": options.socket_timeout,
                                                      "log_request": lambda *a, **k: None})
    http = make_server(options.host, sock.getsockname()[1], create_app(server.service, server.keys),
                       threaded=True, fd=sock.fileno(), request_handler=handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    host, port = sock.getsockname()[:2]
    log.info("FedMoE serving listening on http://%s:%d (base model %s, %s)", host, port,
             server.service.base_model_id, "API keys from " + str(options.api_key_file)
             if options.api_key_file else "no authentication")
    try:
        http.serve_forever()
    finally:
        server.close()
