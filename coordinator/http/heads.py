"""HTTP/1.1 request heads for the buffering front (coordinator/http/front.py): parse, check, build WSGI environ.

Parsed by h11 (python-hyper/h11 0.16, the parser uvicorn and hypercorn use: request line, field names and values,
Content-Length, Host on HTTP/1.1, chunked framing), instead of the regular expressions of our own this module had
until issue 31. On top of h11, strict on purpose: a head we are not sure how to read is a 400, never a guess, so that
what the front takes for one request is what the application sees, and what any proxy before us saw:

- no NUL, and no CR or LF outside a CRLF line end (RFC 9110 5.5: h11 would take a bare LF as a line end);
- no obs-fold (RFC 9112 5.2 lets a server unfold, as h11 does; a proxy that does not sees other headers);
- no transfer coding but ``chunked`` alone, and not Content-Length and Transfer-Encoding both (RFC 9112 6.1: the
  classic request smuggling pair; h11 would let Transfer-Encoding win);
- HTTP/1.0 and 1.1 only; at most MAX_HEADERS fields; the head within HEAD_LIMIT bytes.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from typing import IO, Any
from urllib.parse import unquote_to_bytes

import h11

HEAD_LIMIT = 64 << 10  # bytes of request line + headers (a pushed update's metadata header is ~1 KiB)
MAX_HEADERS = 100
_TRANSFER_ENCODINGS = re.compile(rb"\r\ntransfer-encoding[ \t]*:[ \t]*([^\r]*?)[ \t]*(?=\r\n)", re.IGNORECASE)
_BAD_HEAD_BYTE = re.compile(rb"\x00|\r(?!\n)|(?<!\r)\n")  # NUL, or a CR or LF that is not part of a CRLF
_BAD_ANSWER_CHAR = re.compile(r"[\r\n\x00]")
_REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 404: "Not Found", 408: "Request Timeout",
            413: "Payload Too Large", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            501: "Not Implemented", 503: "Service Unavailable", 505: "HTTP Version Not Supported",
            507: "Insufficient Storage"}


class HttpError(Exception):
    """A request the front answers itself (then closes the connection)."""

    def __init__(self, status: int, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.details = status, code, message, details


@dataclass
class RequestHead:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    """(lower-case name, value) in arrival order."""
    parser: h11.Connection | None = field(default=None, repr=False, compare=False)
    """The h11 connection that parsed this head: it reads a chunked body's framing next."""

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k == name]
        return ", ".join(values) if values else None

    @property
    def chunked(self) -> bool:
        return self.header("transfer-encoding") is not None

    @property
    def content_length(self) -> int:
        """Bytes of body announced (0 if none); HttpError if unreadable."""
        values = {v.strip() for k, v in self.headers if k == "content-length"}
        if not values:
            return 0
        if len(values) > 1 or not re.fullmatch(r"[0-9]{1,18}", next(iter(values))):
            raise HttpError(400, "bad_request", f"bad Content-Length {sorted(values)!r}")
        return int(next(iter(values)))

    @property
    def expects_continue(self) -> bool:
        """Whether the client waits for "100 Continue" before it sends the body (HTTP/1.0: ignored, RFC 9110 10.1.1)."""
        return self.version == "1.1" and (self.header("expect") or "").strip().lower() == "100-continue"

    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in (self.header("connection") or "").split(",")}
        return "close" not in tokens if self.version == "1.1" else "keep-alive" in tokens


def check_head_bytes(raw: bytes) -> None:
    """Refuse a head with a NUL, or a CR or LF outside a CRLF line end (400).

    RFC 9110 section 5.5: a field value holding CR, LF or NUL is invalid and dangerous, to be rejected or each
    replaced by a space. We reject: a bare LF is a line end to some parsers (RFC 9112 section 2.2 allows it) and
    part of the value to others, so a head that two parsers split differently is never passed on (issue 30, 6).
    """
    bad = _BAD_HEAD_BYTE.search(raw)
    if bad is not None:
        start = raw.rfind(b"\r\n", 0, bad.start()) + 2 if bad.start() else 0
        what = {b"\0": "a NUL byte", b"\r": "a CR not followed by LF"}.get(bad.group(), "an LF not preceded by CR")
        raise HttpError(400, "bad_request", f"{what} in the request head, at {raw[start:bad.end()][:80]!r}: header "
                        "lines end with CRLF and a value may not hold CR, LF or NUL (RFC 9110 section 5.5)")


def parse_head(raw: bytes) -> RequestHead:
    """Parse ``raw`` (request line and headers, ending in a blank line) or raise HttpError (400, 431)."""
    check_head_bytes(raw)
    if b"\r\n " in raw or b"\r\n\t" in raw:  # before the final blank line, only a folded line starts so
        raise HttpError(400, "bad_request", "a header line starts with whitespace (obs-fold, RFC 9112 section 5.2): "
                        "send each header on one line")
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_LIMIT)
    parser.receive_data(raw)
    try:
        request = parser.next_event()
    except h11.RemoteProtocolError as exc:
        if exc.error_status_hint == 501:  # a transfer coding h11 does not take: more than "chunked" alone
            raise _unsupported_transfer_encoding(raw) from None
        raise HttpError(400, "bad_request", f"malformed request head: {exc}") from None
    if not isinstance(request, h11.Request):  # a complete head always parses to a request or an error
        raise HttpError(400, "bad_request", "no request line")
    head = RequestHead(request.method.decode("ascii"), request.target.decode("ascii"),
                       request.http_version.decode("ascii"),
                       [(k.decode("ascii"), v.decode("latin-1")) for k, v in request.headers], parser)
    if head.version not in ("1.0", "1.1"):
        raise HttpError(400, "bad_request", f"HTTP/{head.version} is not spoken here; send HTTP/1.1")
    if len(head.headers) > MAX_HEADERS:
        raise HttpError(431, "request_header_fields_too_large", f"more than {MAX_HEADERS} headers")
    if head.chunked and head.header("content-length") is not None:
        raise HttpError(400, "bad_request", "a request may not carry both Content-Length and Transfer-Encoding")
    head.content_length  # noqa: B018 - raises on a bad value before any body is read
    return head


def _unsupported_transfer_encoding(raw: bytes) -> HttpError:
    # RFC 9112 section 6.1 suggests 501 for a transfer coding the server does not understand. We answer 400: the
    # request is the client's to fix (a 5xx here is counted as our bug, warned about in the log and by
    # bench/hostile_surface.py), and a client never retries it. The body's framing is unknown, so the connection
    # closes after the answer, as after every error the front answers itself.
    encoding = ", ".join(v.decode("latin-1") for v in _TRANSFER_ENCODINGS.findall(raw))
    return HttpError(400, "bad_request", f"Transfer-Encoding {encoding[:80]!r} is not supported: send the body with "
                     "Content-Length, or with 'Transfer-Encoding: chunked' alone", reason="unsupported_transfer_encoding")


def wsgi_environ(head: RequestHead, body: IO[bytes], body_size: int, server: tuple[str, int],
                 peer: tuple[str, int] | None, scheme: str, file_wrapper: Any) -> dict[str, Any]:
    """The WSGI environ of a fully received request (``body`` is already complete and rewound)."""
    target = head.target
    if "://" in target:  # absolute-form: keep the path and query
        target = "/" + target.split("://", 1)[1].partition("/")[2]
    path, _, query = target.partition("?")
    environ: dict[str, Any] = {
        "REQUEST_METHOD": head.method, "SCRIPT_NAME": "", "QUERY_STRING": query,
        "PATH_INFO": unquote_to_bytes(path).decode("latin-1"), "RAW_URI": head.target,
        "SERVER_NAME": str(server[0]), "SERVER_PORT": str(server[1]), "SERVER_PROTOCOL": f"HTTP/{head.version}",
        "REMOTE_ADDR": peer[0] if peer else "", "REMOTE_PORT": str(peer[1]) if peer else "",
        "CONTENT_LENGTH": str(body_size), "wsgi.version": (1, 0), "wsgi.url_scheme": scheme,
        "wsgi.input": body, "wsgi.input_terminated": True, "wsgi.errors": sys.stderr,
        "wsgi.multithread": True, "wsgi.multiprocess": False, "wsgi.run_once": False,
        "wsgi.file_wrapper": file_wrapper,
    }
    for name, value in head.headers:
        if "_" in name or name in ("content-length", "transfer-encoding"):  # the body is de-chunked and counted
            continue  # underscores: X_Forwarded vs X-Forwarded would map to one WSGI key
        if name == "content-type":
            environ["CONTENT_TYPE"] = value
            continue
        key = "HTTP_" + name.upper().replace("-", "_")
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    return environ


def response_head(status: str, headers: list[tuple[str, str]], keep_alive: bool) -> bytes:
    """An answer's status line and headers; ValueError if the application put a CR, LF or NUL in one (a header
    that would split the answer in two: the front answers 500 instead)."""
    lines = [f"HTTP/1.1 {status}"]
    lines += [f"{k}: {v}" for k, v in headers if k.lower() != "connection"]
    if any(_BAD_ANSWER_CHAR.search(line) for line in lines):
        raise ValueError(f"the application's answer has a CR, LF or NUL in its status or a header: {lines!r:.200}")
    lines.append("Connection: " + ("keep-alive" if keep_alive else "close"))
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def error_response(status: int, code: str, message: str, details: dict[str, Any] | None = None) -> bytes:
    """A complete JSON error answer the front sends itself, closing the connection."""
    error: dict[str, Any] = {"code": code, "message": message, **({"details": details} if details else {})}
    body = json.dumps({"error": error}).encode()
    head = response_head(f"{status} {_REASONS.get(status, 'Error')}",
                         [("Content-Type", "application/json"), ("Content-Length", str(len(body)))], False)
    return head + body
