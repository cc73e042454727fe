"""Resumable pulls: an interrupted download continues with ``Range`` + ``If-Range`` where it stopped.

On a slow link a pull cut at 90% used to start again from byte 0. Here the bytes already received
stay in the buffer and the rest is asked for with ``Range: bytes=<got>-`` and ``If-Range: <ETag>``:
the server answers 206 with exactly the missing bytes while the ETag still matches, or 200 with
the whole (new) body when the weights changed meanwhile, and then the pull starts over on that
body. The ETag is the SHA-256 of the body, so the assembled bytes are checked against it at the end.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable

import requests
import urllib3

from protocol.errors import Unavailable
from protocol.integrity import algorithm_of, hash_bytes

log = logging.getLogger(__name__)

READ_CHUNK = 4 << 20
CONTENT_ID_ETAG = re.compile(r'^"?((?:b3-)?[0-9a-f]{64})"?$')  # the coordinator's: a blob's content id

Refetch = Callable[[dict[str, str]], requests.Response]
"""Send the same GET again with these extra headers (the caller's retries and auth included)."""


def fill(response: requests.Response, body: bytearray, got: int) -> int:
    """Read the response body into ``body[got:]``; return how far it got (short if the connection dropped)."""
    view = memoryview(body)
    try:
        while got < len(body):
            n = response.raw.readinto(view[got:got + READ_CHUNK])
            if not n:
                break
            got += n
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
        log.info("pull interrupted after %d of %d bytes: %s", got, len(body), exc)
    finally:
        view.release()
        response.close()
    return got


def resumable_body(response: requests.Response, refetch: Refetch, max_resumes: int,
                   where: str) -> tuple[bytearray, requests.Response, int]:
    """The whole body of a 200 response with an ETag, resuming after drops; (body, response it belongs to, resumes)."""
    body = bytearray(int(response.headers["Content-Length"]))
    got, resumes = fill(response, body, 0), 0
    while got < len(body):
        if resumes == max_resumes:
            raise Unavailable(f"pull from {where} kept breaking off (at {got} of {len(body)} bytes after "
                              f"{resumes} resumes); check the link and try again")
        resumes += 1
        etag = response.headers["ETag"]
        log.info("resuming pull from %s at byte %d of %d", where, got, len(body))
        retry = refetch({"Range": f"bytes={got}-", "If-Range": etag})
        if retry.status_code == 206 and retry.headers.get("Content-Range") == f"bytes {got}-{len(body) - 1}/{len(body)}":
            got = fill(retry, body, got)
        elif retry.status_code == 200 and retry.headers.get("ETag") and retry.headers.get("Content-Length", "").isdigit():
            log.info("weights changed during the pull (ETag %s -> %s); starting over", etag, retry.headers["ETag"])
            response, body = retry, bytearray(int(retry.headers["Content-Length"]))
            got = fill(retry, body, 0)
        else:
            retry.close()
            raise Unavailable(f"{where} answered HTTP {retry.status_code} "
                              f"({retry.headers.get('Content-Range')}) to a resume at byte {got}; pull again")
    check_etag(body, response.headers["ETag"], where)
    return body, response, resumes


def check_etag(body: bytearray, etag: str, where: str) -> None:
    """When the ETag is a content id (the coordinator's are: BLAKE3 ``b3-<hex>`` or SHA-256 hex), the
    assembled body must hash to it."""
    m = CONTENT_ID_ETAG.match(etag)
    if m and hash_bytes(body, algorithm_of(m.group(1))) != m.group(1):
        raise Unavailable(f"pull from {where} does not match its ETag after reassembly; pull again")


def can_resume(response: requests.Response) -> bool:
    """Only a plain 200 with a length and a strong ETag can be resumed byte-exactly."""
    h = response.headers
    return (response.status_code == 200 and h.get("Content-Length", "").isdigit() and not h.get("Content-Encoding")
            and bool(h.get("ETag")) and not h["ETag"].startswith("W/"))
