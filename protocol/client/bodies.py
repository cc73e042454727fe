"""Request and response bodies the client sends and reads without copying them whole."""
from __future__ import annotations

from collections.abc import Iterator

import requests
import urllib3

from protocol.errors import Unavailable

PULL_CHUNK = 4 << 20  # bytes read from the socket at a time into a pull's preallocated buffer


class Chunks:
    """A request body sent as 4 MiB views of one buffer, with its Content-Length.

    Python's ``sendall`` applies the socket timeout to the *whole* call, so one ``sendall`` of
    a 1 GiB body failed with "timed out" whenever the coordinator took longer than the 5 s
    connect timeout to take it all; per chunk, the timeout means "no progress for 5 s". The
    views copy nothing, and iterating again (a retry) starts from the first byte.
    """

    def __init__(self, body: bytes) -> None:
        self._view = memoryview(body).cast("B")

    def __len__(self) -> int:
        return len(self._view)

    def __iter__(self) -> Iterator[memoryview]:
        return (self._view[i:i + PULL_CHUNK] for i in range(0, len(self._view), PULL_CHUNK))


def read_body(response: requests.Response, base_url: str) -> bytearray:
    """A response body read straight into one buffer of its Content-Length, chunk by chunk.

    ``response.content`` joins a list of chunks (twice the body at its peak) and the safetensors
    loader then copies every tensor out of it; here the bytes land once and stay where they land.
    """
    try:
        length = response.headers.get("Content-Length")
        if length is None or not length.isdigit() or response.headers.get("Content-Encoding"):
            return bytearray(response.content)
        body = bytearray(int(length))
        view, got = memoryview(body), 0
        while got < len(body):
            n = response.raw.readinto(view[got:got + PULL_CHUNK])
            if not n:
                raise Unavailable(f"connection to {base_url} closed after {got} of {len(body)} body bytes")
            got += n
        return body
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
        raise Unavailable(f"cannot read a response from {base_url}: {reason(exc)}") from None
    finally:
        response.close()


def reason(exc: Exception) -> str:
    """Why a request failed, in a few words (no URL, no credentials)."""
    if isinstance(exc, requests.ConnectionError):
        return "connection refused or dropped"
    if isinstance(exc, requests.Timeout):
        return "timed out"
    return type(exc).__name__
