"""What serve() adds around the listening socket: TLS files, socket timeouts, the local token entry.

Socket timeouts: the production front (coordinator/front.py) times out stalled connections itself;
for --debug's werkzeug server, which reads requests with blocking sockets in its threads, we set
SO_RCVTIMEO/SO_SNDTIMEO on the listening socket; Linux copies them to every accepted connection,
and a read or write that makes no progress for that long fails, ending the request.
"""
from __future__ import annotations

import logging
import socket
import ssl
import struct
from pathlib import Path

from coordinator.config import CoordinatorConfig

log = logging.getLogger(__name__)


def set_socket_timeouts(sock: socket.socket, seconds: float) -> None:
    """Make reads and writes on connections accepted from ``sock`` give up after ``seconds`` idle."""
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def check_tls_files(cert: Path | None, key: Path | None) -> None:
    """Fail at start, in one line, if the certificate and key are missing or do not load."""
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert and --tls-key go together; pass both")
    if cert is None or key is None:
        return
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not path.is_file():
            raise ValueError(f"{flag} {str(path)!r} does not exist")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(str(cert), str(key))
    except ssl.SSLError as exc:
        raise ValueError(f"--tls-cert/--tls-key: cannot load {str(cert)!r} with {str(key)!r}: {exc.reason or exc}") \
            from None


def announce(config: CoordinatorConfig, url: str) -> None:
    """Tell the operator how workers on other machines join (never the token itself)."""
    if not config.auth:
        log.warning("--no-auth: anyone who can reach %s can push, pull and revoke; use only on a trusted network",
                    url)
        return
    join_file = config.data_dir / "join_token"
    log.info("workers on this machine need no token; on other machines run: FEDMOE_TOKEN=$(cat %s) "
             "python run_worker.py --coordinator-url %s --specialty NAME (copy the file's content there)",
             join_file.resolve(), url)
    log.info("dashboard: open %s/#token=<content of %s>", url, join_file.resolve())
