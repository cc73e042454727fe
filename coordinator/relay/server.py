"""Serving a relay: the same buffering front as the root, after joining the upstream."""
from __future__ import annotations

import logging
import signal
import sys

import torch

from coordinator.data_dir import RELAY, claim_data_dir
from coordinator.admission import HeadAdmission
from coordinator.front import BufferingFront, FrontOptions, raise_fd_limit
from coordinator.hardening import set_socket_timeouts
from coordinator.relay.api import create_relay_app
from coordinator.relay.service import RelayConfig
from coordinator.server import ServeOptions, bind

log = logging.getLogger(__name__)


def serve_relay(config: RelayConfig, options: ServeOptions) -> None:
    """Run a relay until interrupted; RelayStartError (one line) if the upstream refuses it."""
    torch.set_num_threads(1)
    sock = bind(options.host, options.port)
    set_socket_timeouts(sock, options.socket_timeout)
    try:  # one process per data dir, and never a root's (coordinator/data_dir.py)
        data_dir_lock = claim_data_dir(config.coordinator.data_dir, RELAY)
    except ValueError:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    app = create_relay_app(config, port)
    relay = app.extensions["fedmoe"]
    try:
        relay.join_upstream()
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
        log.info("FedMoE relay %s listening on http://%s:%d (upstream %s, data dir %s, forward every %g s, %s)",
                 relay.relay_id, host, port, config.upstream, config.coordinator.data_dir, config.forward.interval,
                 config.forward.codec)
        if options.debug:
            from werkzeug.serving import make_server

            make_server(host, port, app, threaded=True, fd=sock.fileno()).serve_forever()
        else:
            limit = raise_fd_limit()
            BufferingFront(app, sock, FrontOptions(threads=options.threads, socket_timeout=options.socket_timeout,
                                                   max_body=config.coordinator.max_body_bytes,
                                                   spool_dir=relay.blobs.tmp_dir,
                                                   max_connections=max(64, limit - 256),
                                                   admission=HeadAdmission(app))).run()
    finally:
        relay.close()
        data_dir_lock.close()
