"""Large uploads that wait for the server's verdict on their head before sending the body (Expect: 100-continue).

A push refused from its head (an expired token: 401, over the rate limit: 429, over a route's limit: 413) used to
cost the whole upload first: ``requests`` (http.client underneath) sends the body right after the head and never
waits for an interim answer (psf/requests#713, python/cpython#42550). Here the head goes out with
``Expect: 100-continue``; the coordinator's front answers ``100 Continue`` once the application has accepted the head
(coordinator/api/admission.py), or its refusal instead, and the body is sent only after a ``100`` (RFC 9110 10.1.1).
A server that says nothing within CONTINUE_WAIT (one that ignores the expectation) gets the body anyway.

The exchange is parsed with h11 on a connection of its own (one per large upload; a TLS handshake is small next to a
body of a MiB or more) and handed back as a ``requests.Response``, so callers see no difference.
"""
from __future__ import annotations

import io
import select
import socket
import ssl
from collections.abc import Iterable
from typing import cast
from urllib.parse import urlsplit

import h11
import requests
from requests.structures import CaseInsensitiveDict
from requests.utils import get_encoding_from_headers

EXPECT_FROM = 1 << 20
"""Bodies at least this large wait for the server's verdict on their head."""
CONTINUE_WAIT = 1.0
"""Seconds to wait for "100 Continue" before sending the body anyway (curl waits 1 s too)."""
RECEIVE = 64 << 10


def send_expecting_continue(prepared: requests.PreparedRequest, verify: bool | str,
                            timeout: tuple[float, float]) -> requests.Response:
    """Send ``prepared`` (its body an iterable of byte views, with a Content-Length) and return the final answer.

    Raises what ``requests`` would: ConnectionError (SSLError for TLS), Timeout."""
    assert prepared.url is not None and prepared.method is not None  # prepared by a session
    parts = urlsplit(prepared.url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        sock = _connect(parts.scheme, parts.hostname or "", parts.port, verify, timeout)
    except ssl.SSLError as exc:
        raise requests.exceptions.SSLError(str(exc)) from None
    except TimeoutError as exc:
        raise requests.exceptions.ConnectTimeout(str(exc)) from None
    except OSError as exc:
        raise requests.ConnectionError(str(exc)) from None
    with sock:
        try:
            return _exchange(sock, prepared, parts.netloc, target)
        except TimeoutError as exc:
            raise requests.exceptions.ReadTimeout(str(exc)) from None
        except (OSError, h11.ProtocolError) as exc:
            raise requests.ConnectionError(f"{type(exc).__name__}: {exc}") from None


def _connect(scheme: str, host: str, port: int | None, verify: bool | str,
             timeout: tuple[float, float]) -> socket.socket:
    sock = socket.create_connection((host, port or (443 if scheme == "https" else 80)), timeout=timeout[0])
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if scheme == "https":
        context = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
        if verify is False:
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        try:
            sock = context.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
    sock.settimeout(timeout[1])
    return sock


def _exchange(sock: socket.socket, prepared: requests.PreparedRequest, host: str, target: str) -> requests.Response:
    conn = h11.Connection(h11.CLIENT)
    headers = [("Host", host), *((k, v if isinstance(v, str) else v.decode("latin-1"))
                                 for k, v in prepared.headers.items() if k.lower() not in ("host", "expect")),
               ("Expect", "100-continue")]
    sock.sendall(conn.send(h11.Request(method=prepared.method or "POST", target=target, headers=headers)))
    verdict = _interim_or_final(sock, conn)
    if not isinstance(verdict, h11.Response):  # "100 Continue", or silence: the body goes
        for piece in _body_pieces(prepared.body):
            # a view of the caller's buffer, written as it is (h11 only counts it against the Content-Length)
            for data in conn.send_with_data_passthrough(h11.Data(data=cast(bytes, piece))) or ():
                sock.sendall(data)
        sock.sendall(conn.send(h11.EndOfMessage()) or b"")
        verdict = _final(sock, conn)
    return _response(prepared, verdict, _body(sock, conn))


def _interim_or_final(sock: socket.socket, conn: h11.Connection) -> h11.Response | h11.InformationalResponse | None:
    """The server's first answer to the head, or None if it says nothing within CONTINUE_WAIT."""
    ready = (isinstance(sock, ssl.SSLSocket) and sock.pending()) or select.select([sock], [], [], CONTINUE_WAIT)[0]
    if not ready:
        return None
    event = _next(sock, conn)
    if not isinstance(event, (h11.Response, h11.InformationalResponse)):
        raise h11.RemoteProtocolError(f"expected a response, got {event!r}")
    return event


def _final(sock: socket.socket, conn: h11.Connection) -> h11.Response:
    while True:
        event = _next(sock, conn)
        if isinstance(event, h11.Response):
            return event
        if not isinstance(event, h11.InformationalResponse):  # a 100 that came late: skipped
            raise h11.RemoteProtocolError(f"expected a response, got {event!r}")


def _body(sock: socket.socket, conn: h11.Connection) -> bytes:
    chunks = []
    while not isinstance(event := _next(sock, conn), h11.EndOfMessage):
        if not isinstance(event, h11.Data):
            raise h11.RemoteProtocolError(f"expected the response's body, got {event!r}")
        chunks.append(bytes(event.data))
    return b"".join(chunks)


def _next(sock: socket.socket, conn: h11.Connection) -> h11.Event:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(RECEIVE))  # b"" (the server closed) makes h11 say what was cut short
            continue
        if event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
            raise h11.RemoteProtocolError("the server closed the connection before its answer ended")
        return event  # type: ignore[return-value]  # an event, the sentinels are handled above


def _body_pieces(body: object) -> Iterable[bytes | bytearray | memoryview]:
    if body is None:
        return ()
    if isinstance(body, (bytes, bytearray, memoryview)):
        return (body,)
    return cast(Iterable[memoryview], body)  # protocol.client.bodies.Chunks: views of one buffer


def _response(prepared: requests.PreparedRequest, final: h11.Response, body: bytes) -> requests.Response:
    response = requests.Response()
    response.status_code = final.status_code
    response.reason = final.reason.decode("latin-1")
    response.headers = CaseInsensitiveDict({k.decode("latin-1"): v.decode("latin-1") for k, v in final.headers})
    response.encoding = get_encoding_from_headers(response.headers)
    response.raw = io.BytesIO(body)
    response.url = prepared.url or ""
    response.request = prepared
    return response
