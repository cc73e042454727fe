"""Large pushes wait for the coordinator's verdict on their head (protocol/expect.py, issue 30.8): a refusal costs no
upload, and the front answers "100 Continue" only when it will read the body. A real coordinator, and a counting
proxy (bench/wanemu/cut.py) between it and the client for the bytes that crossed."""
from __future__ import annotations

import json
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.common import SCRATCH_DIR, CoordinatorProcess, coordinator_process
from bench.wanemu.cut import CutProxy
from protocol.client import CoordinatorClient, RetryPolicy
from protocol.errors import Unauthorized
from protocol.expect import EXPECT_FROM
from protocol.integrity import digest_header
from protocol.schemas import UPDATE_HEADER
from protocol.tensors import dumps
from tests.helpers import expert_spec, make_adapter, random_like, update_meta

ADAPTER = make_adapter(layers=8, d_in=8192, d_out=64)  # ~4.4 MiB as safetensors: a one-shot push (under 8 MiB)


@pytest.fixture(scope="module")
def coordinator() -> Iterator[CoordinatorProcess]:
    with tempfile.TemporaryDirectory(prefix="fedmoe-expect-", dir=SCRATCH_DIR) as scratch, \
            coordinator_process(Path(scratch) / "data") as server:
        CoordinatorClient(server.url).experts.create("e", ADAPTER, expert_spec())
        yield server


def through_proxy(server: CoordinatorProcess, token: str | None = None) -> tuple[CutProxy, CoordinatorClient]:
    host, port = server.url.split("://")[1].split(":")
    proxy = CutProxy((host, int(port)))
    return proxy, CoordinatorClient(proxy.url(), token=token, retry=RetryPolicy(attempts=1))


def test_a_push_refused_from_its_head_sends_no_body(coordinator):
    body = dumps(random_like(ADAPTER, 1))
    assert len(body) >= EXPECT_FROM
    proxy, client = through_proxy(coordinator, token="not-a-token")
    with pytest.raises(Unauthorized):
        client.updates.push("e", body, update_meta())
    assert proxy.bytes_to_target < 16 << 10  # the head only (was the whole 4.4 MiB body: requests sends it anyway)

    proxy, admin = through_proxy(coordinator, coordinator.headers["Authorization"].split()[1])  # accepted: the body follows "100 Continue", the push lands
    assert admin.updates.push("e", body, update_meta())["status"] in ("pending", "applied")
    assert len(body) < proxy.bytes_to_target < len(body) + (16 << 10)


def _exchange(server: CoordinatorProcess, token: str, body: bytes) -> list[bytes]:
    """A push with Expect: 100-continue by hand: the status lines the front sends, in order, sending the body only
    after a 100."""
    host, port = server.url.split("://")[1].split(":")
    head = (f"POST /api/v1/experts/e/updates HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n{UPDATE_HEADER}: {json.dumps(update_meta())}\r\n"
            f"X-FedMoE-Digest: {digest_header(body)}\r\n\r\n").encode()
    statuses, answer = [], b""
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head)
        while True:
            while b"\r\n\r\n" not in answer and (piece := sock.recv(65536)):
                answer += piece
            line, _, answer = answer.partition(b"\r\n")
            statuses.append(line)
            answer = answer.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in answer else b""
            if not line.startswith(b"HTTP/1.1 100 "):
                return statuses
            sock.sendall(body)


@pytest.mark.parametrize("small", [True, False], ids=["100 bytes", "4.4 MiB"])  # the client waits for any size
def test_the_front_says_100_continue_only_to_a_head_it_accepts(coordinator, small):
    body = b"x" * 100 if small else dumps(random_like(ADAPTER, 3))
    refused = _exchange(coordinator, "not-a-token", body)
    assert len(refused) == 1 and refused[0].startswith(b"HTTP/1.1 401 "), refused  # the refusal, no 100 first
    if not small:
        accepted = _exchange(coordinator, coordinator.headers["Authorization"].split()[1], body)
        assert accepted[0].startswith(b"HTTP/1.1 100 ") and accepted[1].startswith(b"HTTP/1.1 202 "), accepted
