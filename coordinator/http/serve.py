"""The one way FedMoE's servers answer HTTP: the root, a relay and serve.py all call ``serve``.

Before, the root and the relay each had a serve function of their own and only the root's wired TLS: a relay
started with --tls-cert/--tls-key answered plain HTTP, silently (issue 30). Here the caller binds the listening
socket (so a port in use fails before anything slow starts, and ``--port 0`` works) and hands it, the WSGI app and
the front's options to ``serve``, which runs the buffering front (coordinator/http/front.py), with TLS when the options
name a certificate, or werkzeug's development server (TLS too) for --debug.
"""
from __future__ import annotations

import logging
import socket
import ssl
from dataclasses import replace
from pathlib import Path

from coordinator.http.front import BufferingFront, raise_fd_limit
from coordinator.http.options import FrontOptions
from coordinator.http.wsgi import WsgiApp
from coordinator.http.listening import check_tls_files, set_socket_timeouts

log = logging.getLogger(__name__)
FD_RESERVE = 256  # open files kept for everything but connections (data dir, spool files, sockets upstream)


class ServerStartError(Exception):
    """The server could not start (port in use, bad address)."""


def bind(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A listening socket on ``host:port`` (0: a free port), or ServerStartError in one line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = " (is another server running there? pick another --port)" if port else ""
        raise ServerStartError(f"cannot listen on {host}:{port}: {exc.strerror}{hint}") from None
    sock.listen(backlog)  # a burst of connections (1,000 workers syncing at once) is not refused
    sock.set_inheritable(True)
    return sock


def scheme(options: FrontOptions) -> str:
    return "https" if options.tls_cert is not None else "http"


def tls_context(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    """The server's TLS context for ``cert`` and ``key`` (None without them); ValueError in one line if they do not
    load (``check_tls_files``: call it at start, before anything slow)."""
    check_tls_files(cert, key)
    if cert is None or key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert), str(key))
    return context


def serve(app: WsgiApp, listener: socket.socket, options: FrontOptions, debug: bool = False) -> None:
    """Answer HTTP, or HTTPS when ``options`` name a certificate, on ``listener`` until SIGTERM or SIGINT."""
    tls = tls_context(options.tls_cert, options.tls_key)
    if debug:
        _serve_debug(app, listener, options)
        return
    limit = raise_fd_limit()
    if limit < 2048:
        log.warning("the open-files limit is %d (ulimit -n); each client connection needs one", limit)
    options = replace(options, max_connections=min(options.max_connections, max(64, limit - FD_RESERVE)))
    BufferingFront(app, listener, options, tls).run()


def _serve_debug(app: WsgiApp, listener: socket.socket, options: FrontOptions) -> None:
    """werkzeug's threaded development server: its request threads read with blocking sockets, so the socket
    timeouts (set on the listening socket, copied to every accepted one) bound a stalled client."""
    from werkzeug.serving import make_server

    log.warning("--debug: serving with Flask's development server; not for production")
    set_socket_timeouts(listener, options.socket_timeout)
    host, port = listener.getsockname()[:2]
    tls = (str(options.tls_cert), str(options.tls_key)) if options.tls_cert is not None else None
    make_server(host, port, app, threaded=True, fd=listener.fileno(), ssl_context=tls).serve_forever()
