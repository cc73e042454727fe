"""Small real objects the tests share: LoRA adapters and raw HTTP calls."""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Any

import torch

# The tests' adapters, specs and update metadata are the benches' own (bench never imports tests).
from bench.updates import FINGERPRINT, expert_spec, make_adapter, random_like, update_meta  # noqa: F401
from protocol.schemas import EXPERT_HEADER, UPDATE_HEADER
from protocol.tensors import dumps


def put_expert(client, name: str, tensors, spec: dict[str, Any] | None = None):
    """PUT an expert through a Flask test client."""
    return client.put(f"/api/v1/experts/{name}", data=dumps(tensors),
                      headers={EXPERT_HEADER: json.dumps(spec or expert_spec())})


def push(client, name: str, delta, meta: dict[str, Any] | None = None, body: bytes | None = None):
    """POST an update through a Flask test client."""
    return client.post(f"/api/v1/experts/{name}/updates", data=dumps(delta) if body is None else body,
                       headers={UPDATE_HEADER: json.dumps(meta or update_meta())})


def serve_on_loopback(app):
    """(server, URL) of a WSGI app served on a free loopback port in a thread; ``server.shutdown()`` stops it."""
    import threading

    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


def relay_join_token(root_data_dir) -> str:
    """The root's relay join token (coordinator/access/tokens.py): what a relay registers at the root with."""
    return (root_data_dir / "relay_join_token").read_text().strip()


@contextmanager
def relay_sites(tmp_path, root: dict[str, Any] | None = None, relay_coordinator: dict[str, Any] | None = None,
                **relay_settings: Any):
    """A real root holding expert ``e1`` (``CoordinatorConfig`` settings ``root``) and a real relay ``r1`` under it
    (``RelayConfig`` settings ``relay_settings``, its ``CoordinatorConfig`` settings ``relay_coordinator``; forwarding
    only when a test asks), each on a loopback port. Yields (a client of the root
    registered as worker ``w-root``, the relay service, a client of the relay registered as ``w1``, the root URL)."""
    from coordinator.api.app import create_app
    from coordinator.config import CoordinatorConfig
    from coordinator.relay.api import create_relay_app
    from coordinator.relay.forwarder import ForwardPolicy
    from coordinator.relay.config import RelayConfig
    from protocol.client import CoordinatorClient

    base = {"id": "m", "fingerprint": FINGERPRINT}
    root_app = create_app(CoordinatorConfig(data_dir=tmp_path / "root", gateway_interval=0, **(root or {})))
    root_server, root_url = serve_on_loopback(root_app)
    CoordinatorClient(root_url, token=root_app.extensions["fedmoe_auth"].admin_token).experts.create(
        "e1", make_adapter(), expert_spec())
    join = (tmp_path / "root" / "join_token").read_text().strip()
    relay_app = create_relay_app(RelayConfig(upstream=root_url, join_token=join, relay_id="r1",
                                             relay_join_token=relay_join_token(tmp_path / "root"),
                                             coordinator=CoordinatorConfig(data_dir=tmp_path / "relay",
                                                                           **(relay_coordinator or {})),
                                             forward=ForwardPolicy(interval=3600), **relay_settings))
    relay = relay_app.extensions["fedmoe"]
    relay.join_upstream()
    relay_server, relay_url = serve_on_loopback(relay_app)
    at_root, at_relay = CoordinatorClient(root_url, token=join), CoordinatorClient(relay_url, token=join)
    at_root.workers.register("w-root", "e1", base)
    at_relay.workers.register("w1", "e1", base)
    try:
        yield at_root, relay, at_relay, root_url
    finally:
        for client in (at_root, at_relay):
            client.close()
        relay_server.shutdown()
        relay_server.server_close()
        relay.close()
        root_server.shutdown()
        root_server.server_close()
        root_app.extensions["fedmoe"].close()


def new_root_version(at_root, seed: int) -> int:
    """Push a random update to expert ``e1`` at the root as worker ``w-root`` (see ``relay_sites``); its new version."""
    version = at_root.experts.get("e1")["version"]
    at_root.updates.push("e1", dumps(random_like(make_adapter(), seed)), {
        "update_id": f"root-{seed}", "base_version": version, "num_samples": 4, "worker_id": "w-root"})
    return at_root.experts.get("e1")["version"]


def relay_fetches(relay) -> int:
    """Let the relay's cache take the root's current version of ``e1`` now (as its revalidation would), then
    freeze it (from here a pull never revalidates: any upstream call is a test's); the cached version."""
    relay.cache.revalidate_seconds = 0.0
    version = relay.cache.get("e1", wait=True).version
    relay.cache.revalidate_seconds = 1e9
    return version


def run_main(main, *argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a command's ``main(argv)`` run in this test process, as ``sys.exit(main())``
    would end it: a subprocess spends ~2-6 CPU s importing torch, transformers and peft before its first line.
    A command's ``__main__`` path itself (the import, no traceback) stays checked through one subprocess per
    command; this is for its other cases. Every logger's level and handlers and torch's thread count are put
    back afterwards (bench commands configure logging and set one thread), and so are the environment variables
    (run_worker --threads sets OMP_NUM_THREADS and others for its children); ``env`` adds some for the call."""
    import contextlib
    import io
    import logging
    import os

    def loggers() -> list[logging.Logger]:
        return [logging.root, *(logger for logger in logging.root.manager.loggerDict.values()
                                if isinstance(logger, logging.Logger))]

    saved = {logger: (logger.level, list(logger.handlers), logger.propagate) for logger in loggers()}
    threads = torch.get_num_threads()
    environ = dict(os.environ)
    os.environ.update(env or {})
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:  # argparse's errors, SystemExit("message")
                if isinstance(exc.code, str):
                    print(exc.code, file=sys.stderr)
                code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    finally:
        for logger in loggers():  # a logger first made by the command goes back to NOTSET, no handlers
            level, handlers, propagate = saved.get(logger, (logging.NOTSET, [], True))
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate = propagate
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)
    return code or 0, out.getvalue(), err.getvalue()
