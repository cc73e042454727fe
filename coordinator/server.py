"""Starting the root coordinator: its data dir, its app, then the one serve path (coordinator/http/serve.py).

We bind the listening socket ourselves, so ``--port 0`` works (the chosen port
is logged) and a port in use is one clear error. One process on purpose: the
coordinator keeps per-expert locks in memory, and SQLite has one writer anyway;
request threads give the concurrency, the front's event loop holds the connections.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import threading

import torch

from coordinator.checks import int8_kernel
from coordinator.api.app import create_app
from coordinator.config import CoordinatorConfig, ServeOptions
from coordinator.storage.data_dir import ROOT, claim_data_dir
from coordinator.api.admission import HeadAdmission
from coordinator.api.upload_placement import UploadPlacer
from coordinator.http.listening import announce, check_tls_files
from coordinator.http.options import FrontOptions
from coordinator.http.serve import bind, serve as serve_http
from protocol.credentials import credentials_path, publish_local_token, withdraw_local_token

log = logging.getLogger(__name__)


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """Ask glibc for at most ``arenas`` malloc arenas (before any request thread starts).

    By default every thread that allocates gets its own arena, and memory freed after decoding an
    update stays cached in each of them: 100 clients pushing 4.7 MB int8 updates to 16 request
    threads took the coordinator to 2.6 GB RSS (bench/load.py). No-op where glibc is absent.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_ARENA_MAX = -8  # from glibc's malloc.h
    libc.mallopt(M_ARENA_MAX, arenas)


def serve(config: CoordinatorConfig, options: ServeOptions) -> None:
    """Run until interrupted. Opens the store once up front so errors surface here, not in a fork."""
    # The coordinator's tensor work (finiteness checks, in-place aggregation) is memory-bound, and
    # on a busy machine torch's second thread stalls it: checking a 1 GiB update took 13.7 s with
    # 2 threads and 2.4 s with 1 on 2 loaded cores (bench/transport.py).
    torch.set_num_threads(1)
    _limit_malloc_arenas()
    check_tls_files(options.tls_cert, options.tls_key)
    sock = bind(options.host, options.port)  # a port in use fails before anything is written
    try:  # one process per data dir: held until this process exits (coordinator/storage/data_dir.py)
        data_dir_lock = claim_data_dir(config.data_dir, ROOT)
    except ValueError:
        sock.close()
        raise
    app = create_app(config)
    # compiled int8 loops (coordinator/checks/int8_kernel.py) ready before the first push needs them, without delaying start
    threading.Thread(target=int8_kernel.warm_up, name="fedmoe-warm-up", daemon=True).start()
    # Everything made so far (torch, Flask, the store: a few hundred thousand objects that live as long as
    # the process) leaves the cyclic GC's generations: its full collections, triggered by the objects each
    # request makes, no longer walk them (py-spy under bench.load: GC was ~10% of the coordinator's CPU).
    gc.freeze()
    auth = app.extensions.get("fedmoe_auth")
    host, port = sock.getsockname()[:2]
    scheme = "https" if options.tls_cert else "http"
    # SIGTERM before the front installs its own handler (or with --debug) must still run the finally below.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    # Publish before saying we listen: clients start as soon as they read that line.
    published = auth is not None and _publish(host, port, auth.admin_token, scheme)
    log.info("FedMoE coordinator listening on %s://%s:%d (data dir %s, aggregation %s)",
             scheme, host, port, config.data_dir, config.aggregation)
    announce(config, f"{scheme}://{host}:{port}")
    owner = os.getpid()
    front = FrontOptions(threads=options.threads, socket_timeout=options.socket_timeout,
                         max_body=config.max_body_bytes, spool_dir=app.extensions["fedmoe"].spool_dir,
                         placer=UploadPlacer(app) if "fedmoe_uploads" in app.extensions else None,
                         admission=HeadAdmission(app), tls_cert=options.tls_cert, tls_key=options.tls_key)
    try:
        serve_http(app, sock, front, debug=options.debug)
    finally:
        app.extensions["fedmoe"].close()
        if published and os.getpid() == owner:
            withdraw_local_token(host, port)
        data_dir_lock.close()


def _publish(host: str, port: int, token: str, scheme: str) -> bool:
    """Record the admin token for same-machine clients (protocol.credentials); a failure only warns."""
    try:
        publish_local_token(host, port, token, scheme)
    except OSError as exc:
        log.warning("cannot record the admin token for local clients in %s (%s); they need --token",
                    credentials_path(), exc)
        return False
    return True
