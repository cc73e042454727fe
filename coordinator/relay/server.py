"""Serving a relay: the same one serve path as the root (coordinator/http/serve.py), after joining the upstream."""
from __future__ import annotations

import logging
import signal
import sys

import torch

from coordinator.api.admission import HeadAdmission
from coordinator.config import ServeOptions
from coordinator.storage.data_dir import RELAY, claim_data_dir
from coordinator.http.listening import check_tls_files
from coordinator.http.options import FrontOptions
from coordinator.http.serve import bind, scheme, serve
from coordinator.relay.api import create_relay_app
from coordinator.relay.config import RelayConfig
from coordinator.relay.service import RelayService

log = logging.getLogger(__name__)


def serve_relay(config: RelayConfig, options: ServeOptions) -> None:
    """Run a relay until interrupted; RelayStartError (one line) if the upstream refuses it."""
    torch.set_num_threads(1)
    check_tls_files(options.tls_cert, options.tls_key)  # a bad file fails before the port is taken
    sock = bind(options.host, options.port)
    try:  # one process per data dir, and never a root's (coordinator/storage/data_dir.py)
        data_dir_lock = claim_data_dir(config.coordinator.data_dir, RELAY)
    except ValueError:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    app = create_relay_app(config, port)
    relay = app.extensions["fedmoe"]
    front = FrontOptions(threads=options.threads, socket_timeout=options.socket_timeout,
                         max_body=config.coordinator.max_body_bytes, spool_dir=relay.blobs.tmp_dir,
                         admission=HeadAdmission(app), tls_cert=options.tls_cert, tls_key=options.tls_key)
    try:
        relay.join_upstream()
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
        log.info("FedMoE relay %s listening on %s://%s:%d (upstream %s, data dir %s, forward every %g s, %s)",
                 relay.relay_id, scheme(front), host, port, config.upstream, config.coordinator.data_dir,
                 config.forward.interval, config.forward.codec)
        serve(app, sock, front, debug=options.debug)
    finally:
        if config.forward.on_exit:
            forward_before_exit(relay)
        relay.close()
        data_dir_lock.close()


def forward_before_exit(relay: RelayService) -> None:
    """--forward-on-exit: the front no longer takes requests, so every update acknowledged until now is in the queue;
    forward it once. Best effort: an unreachable root leaves it queued in the data dir, forwarded at the next start."""
    try:
        log.info("forwarding before exit: %d batch(es) delivered", relay.forwarder.flush())
    except Exception as exc:  # noqa: BLE001 - shutting down: the queue is durable whatever went wrong here
        log.warning("could not forward before exit (%s); the queue stays in the data dir", exc)
