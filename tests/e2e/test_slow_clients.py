"""Slow clients must not deny service (issue 13, defect 2): heads and bodies that drip in hold a
socket, never a request thread, so a normal client is answered while they are all still open.

Not a timed test: the assertion is that the normal requests complete (generous timeouts) while
every slow connection is still open, which failed with gunicorn's 16 threads and 16 drippers.
"""
from __future__ import annotations

import json
import socket
import ssl
from urllib.parse import urlsplit

import pytest
import requests

from protocol.schemas import EXPERT_HEADER, UPDATE_HEADER
from protocol.tensors import dumps
from tests.e2e.conftest import admin_headers
from tests.e2e.test_security import self_signed
from tests.helpers import expert_spec, make_adapter, random_like, update_meta

DRIPPERS = 100  # > 6x the request threads
SLOW_BODIES = 20


def open_slow(address: tuple[str, int], tls: bool, head: bytes) -> socket.socket:
    sock = socket.create_connection(address, timeout=60)
    if tls:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        sock = context.wrap_socket(sock)
    sock.sendall(head)
    return sock


def still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""  # bytes: the server answered something; b"": it closed
    except (BlockingIOError, ssl.SSLWantReadError):
        return True  # nothing to read and no end: open
    except OSError:
        return False
    finally:
        sock.setblocking(True)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_normal_requests_are_answered_while_100_slow_clients_hold_connections(start_coordinator, tmp_path, tls):
    cert, key = map(str, self_signed(tmp_path)) if tls else (None, None)
    proc, url = start_coordinator(*(["--tls-cert", cert, "--tls-key", key] if tls else []))
    address = urlsplit(url).hostname, urlsplit(url).port
    headers = admin_headers(url)
    adapter = make_adapter()
    assert requests.put(f"{url}/api/v1/experts/e", data=dumps(adapter), verify=cert or True, timeout=60,
                        headers={**headers, EXPERT_HEADER: json.dumps(expert_spec())}).status_code == 201
    slow = [open_slow(address, tls, b"GET /api/v1/health HTTP/1.1\r\nHost: x\r\n") for _ in range(DRIPPERS)]
    slow += [open_slow(address, tls, b"POST /api/v1/experts/e/updates HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Length: 1000000\r\n\r\nxx") for _ in range(SLOW_BODIES)]
    try:
        for sock in slow[:DRIPPERS:10]:  # some drip another header line meanwhile
            sock.sendall(b"X-Drip: 1\r\n")
        health = requests.get(f"{url}/api/v1/health", verify=cert or True, timeout=120)
        pushed = requests.post(f"{url}/api/v1/experts/e/updates", data=dumps(random_like(adapter, 1)),
                               verify=cert or True, timeout=120,
                               headers={**headers, UPDATE_HEADER: json.dumps(update_meta())})
        assert (health.status_code, health.json()["status"]) == (200, "ok")
        assert pushed.status_code == 202, pushed.text
        assert sum(still_open(sock) for sock in slow) == len(slow)  # answered while all were held
    finally:
        for sock in slow:
            sock.close()
    assert requests.get(f"{url}/api/v1/experts/e", headers=headers, verify=cert or True,
                        timeout=60).json()["version"] == 1
    assert "Traceback" not in "".join(proc.log)
