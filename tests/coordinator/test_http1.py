"""Request heads as the buffering front reads them (coordinator/http/heads.py): strict, never a guess."""
from __future__ import annotations

import io
import json

import pytest

from coordinator.http.heads import HttpError, parse_head, wsgi_environ, error_response


def head(*lines: str) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def head11(request_line: str, *lines: str) -> bytes:
    """An HTTP/1.1 head with its mandatory Host (RFC 9112 section 3.2)."""
    return head(request_line, "Host: h", *lines)


def test_a_push_head_is_read_with_its_length_and_headers():
    h = parse_head(head("POST /api/v1/experts/e/updates?x=1 HTTP/1.1", "Host: a", "Content-Length: 123",
                        "X-FedMoE-Update: {\"a\": 1}", "X-Twice: 1", "X-Twice: 2"))
    assert (h.method, h.target, h.version, h.content_length, h.chunked) == (
        "POST", "/api/v1/experts/e/updates?x=1", "1.1", 123, False)
    assert h.header("x-twice") == "1, 2" and h.keep_alive()
    environ = wsgi_environ(h, io.BytesIO(b"x" * 123), 123, ("127.0.0.1", 5000), ("127.0.0.1", 4242), "https", None)
    assert (environ["PATH_INFO"], environ["QUERY_STRING"], environ["CONTENT_LENGTH"]) == (
        "/api/v1/experts/e/updates", "x=1", "123")
    assert environ["HTTP_X_FEDMOE_UPDATE"] == '{"a": 1}' and environ["HTTP_X_TWICE"] == "1,2"
    assert (environ["wsgi.url_scheme"], environ["REMOTE_ADDR"]) == ("https", "127.0.0.1")


def test_a_chunked_body_reaches_the_app_counted_and_de_chunked():
    h = parse_head(head11("POST /x HTTP/1.1", "Transfer-Encoding: chunked"))
    environ = wsgi_environ(h, io.BytesIO(b"abc"), 3, ("h", 1), None, "http", None)
    assert h.chunked and environ["CONTENT_LENGTH"] == "3" and "HTTP_TRANSFER_ENCODING" not in environ


@pytest.mark.parametrize("lines, status", [
    (("BLAH",), 400),
    (("GET / HTTP/2.0", "Host: h"), 400),
    (("GET / HTTP/1.1",), 400),  # no Host (RFC 9112 section 3.2)
    (("GET / HTTP/1.1", "Host: a", "Host: b"), 400),
    (("GET /a b HTTP/1.1", "Host: h"), 400),
    (("GET / HTTP/1.1", "Host: h", "Content-Length: 5", "Transfer-Encoding: chunked"), 400),  # smuggling
    (("GET / HTTP/1.1", "Host: h", "Transfer-Encoding: chunked", "Content-Length: 5"), 400),
    (("GET / HTTP/1.1", "Host: h", "Content-Length: 5", "Content-Length: 6"), 400),
    (("GET / HTTP/1.1", "Host: h", "Content-Length: 5, 6"), 400),
    (("GET / HTTP/1.1", "Host: h", "Content-Length: -1"), 400),
    (("GET / HTTP/1.1", "Host: h", "Content-Length: 1e3"), 400),
    (("GET / HTTP/1.1", "Host: h", "Content-Length: " + "9" * 19), 400),
    (("GET / HTTP/1.1", "Host: h", "Transfer-Encoding: gzip"), 400),
    (("GET / HTTP/1.1", "Host: a", " folded"), 400),
    (("GET / HTTP/1.1", "Host: a", "\tfolded"), 400),
    (("GET / HTTP/1.1", "Host: h", "Bad Name: a"), 400),
    (("GET / HTTP/1.1", "Host: h", "Name : a"), 400),  # whitespace before the colon
    (("GET / HTTP/1.1", "Host: h", *[f"X-{i}: 1" for i in range(101)]), 431),
])
def test_heads_we_cannot_read_for_sure_are_refused(lines, status):
    with pytest.raises(HttpError) as caught:
        parse_head(head(*lines))
    assert caught.value.status == status


@pytest.mark.parametrize("line, what", [
    ("X-A: one\nTransfer-Encoding: chunked", "an LF not preceded by CR"),  # a second header to some parsers
    ("X-A: a\nb", "an LF not preceded by CR"),
    ("X-A: a\x00b", "a NUL byte"),
    ("X-A: a\rb", "a CR not followed by LF"),
    ("X-A\x00: a", "a NUL byte"),
])
def test_a_cr_lf_or_nul_inside_a_header_is_refused_not_passed_on(line, what):
    """RFC 9110 section 5.5 (issue 30, 6): these were accepted and reached the application inside the value."""
    with pytest.raises(HttpError) as caught:
        parse_head(head("GET / HTTP/1.1", "Host: a", line))
    assert (caught.value.status, caught.value.code) == (400, "bad_request")
    assert caught.value.message.startswith(what) and "RFC 9110" in caught.value.message


@pytest.mark.parametrize("encoding", ["gzip", "chunked, gzip", "gzip, chunked", "identity", "chunked, chunked",
                                      "x\x7f\xff garbage", ""])
def test_a_transfer_encoding_other_than_chunked_is_the_clients_400_not_a_501(encoding):
    with pytest.raises(HttpError) as caught:
        parse_head(head11("POST /x HTTP/1.1", f"Transfer-Encoding: {encoding}"))
    exc = caught.value
    assert (exc.status, exc.code, exc.details) == (400, "bad_request", {"reason": "unsupported_transfer_encoding"})
    assert repr(encoding) in exc.message and "Content-Length" in exc.message and "chunked" in exc.message
    raw = error_response(exc.status, exc.code, exc.message, exc.details)
    head_part, body = raw.split(b"\r\n\r\n", 1)
    assert head_part.startswith(b"HTTP/1.1 400 Bad Request") and b"Connection: close" in head_part
    assert json.loads(body)["error"]["details"] == {"reason": "unsupported_transfer_encoding"}


def test_http_1_0_closes_unless_asked_and_1_1_keeps_unless_asked():
    assert not parse_head(head("GET / HTTP/1.0")).keep_alive()
    assert parse_head(head("GET / HTTP/1.0", "Connection: keep-alive")).keep_alive()
    assert not parse_head(head11("GET / HTTP/1.1", "Connection: close")).keep_alive()


def test_headers_with_underscores_are_dropped_not_merged_with_dashes():
    h = parse_head(head11("GET / HTTP/1.1", "X_Forwarded_For: evil", "X-Forwarded-For: good"))
    environ = wsgi_environ(h, io.BytesIO(), 0, ("h", 1), None, "http", None)
    assert environ["HTTP_X_FORWARDED_FOR"] == "good"


def test_the_fronts_own_errors_are_json_and_close():
    raw = error_response(413, "payload_too_large", "body of 9 bytes is over the limit")
    head_part, body = raw.split(b"\r\n\r\n", 1)
    assert head_part.startswith(b"HTTP/1.1 413 Payload Too Large") and b"Connection: close" in head_part
    assert json.loads(body) == {"error": {"code": "payload_too_large", "message": "body of 9 bytes is over the limit"}}
    assert f"Content-Length: {len(body)}".encode() in head_part
