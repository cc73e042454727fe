"""What serve() adds around the listening socket: TLS files, socket timeouts, the local token entry.

Socket timeouts: the production front (coordinator/http/front.py) times out stalled connections itself;
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
from urllib.parse import urlsplit

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


def reachable_urls(url: str) -> tuple[str, str | None]:
    """(URL for clients on this machine, URL for other machines or None) of a server bound as ``url``.

    A wildcard bind (0.0.0.0, ::) is no address to connect to: this machine uses loopback, others
    this host's outward address (or its name). A loopback bind cannot be reached from elsewhere.
    """
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port
    if host in ("0.0.0.0", "::", ""):
        local = "[::1]" if host == "::" else "127.0.0.1"
        outward = _outward_address() or socket.gethostname()
        return f"{parts.scheme}://{local}:{port}", f"{parts.scheme}://{outward}:{port}"
    if host == "localhost" or host.startswith("127.") or host == "::1":
        return url, None
    return url, url


def _outward_address() -> str | None:
    """The IPv4 address this host would use toward other networks (a UDP connect sends no packet)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.254.254.254", 9))
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def announce(config: CoordinatorConfig, url: str) -> None:
    """Tell the operator how workers join, with addresses they can connect to (never the token itself)."""
    local, remote = reachable_urls(url)
    if not config.auth:
        log.warning("--no-auth: anyone who can reach %s can push, pull and revoke; use only on a trusted network",
                    remote or local)
    run = "python run_worker.py --coordinator-url %s --specialty NAME"
    log.info("workers on this machine: " + run + "%s", local, "" if not config.auth else " (no token needed)")
    join_file = (config.data_dir / "join_token").resolve()
    if remote is None:
        log.info("listening on loopback only: other machines cannot connect (use --host 0.0.0.0 for them)")
    elif config.auth:
        log.info("on other machines: FEDMOE_TOKEN=$(cat %s) " + run + " (copy the file's content there)",
                 join_file, remote)
    else:
        log.info("on other machines: " + run, remote)
    if config.auth:
        log.info("dashboard: open %s/#token=<content of %s>", local, join_file)
    else:
        log.info("dashboard: open %s/", local)
