"""Resumable pushes against a real coordinator (run_coordinator.py) behind a proxy that breaks the upload once."""
from __future__ import annotations

import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
import torch

from bench.common import CoordinatorProcess, SCRATCH_DIR, coordinator_process
from bench.wanemu.cut import CutProxy
from coordinator.http.connection import SPOOL_IN_MEMORY
from protocol.client import CoordinatorClient, RetryPolicy
from protocol.credentials import local_token
from protocol.errors import Unavailable
from protocol.integrity import digest_header
from protocol.tensors import dumps
from protocol.uploads import UploadPolicy
from tests.helpers import expert_spec, make_adapter, random_like, update_meta

ADAPTER = dict(rank=16, d_in=1024, d_out=1024, layers=8)  # 2 MiB of float32
CHUNK = 128 << 10
FIXED_CHUNKS = UploadPolicy(threshold=1, first_chunk=CHUNK, min_chunk=CHUNK, max_chunk=CHUNK)
HEADERS = 8 << 10  # generous allowance for the HTTP heads of the few requests around a break
FAST_RETRY = RetryPolicy(attempts=4, base_delay=0.05)

pytestmark = pytest.mark.e2e


@contextmanager
def _started() -> Iterator[CoordinatorProcess]:
    with tempfile.TemporaryDirectory(prefix="fedmoe-test-", dir=SCRATCH_DIR) as data_dir:
        with coordinator_process(Path(data_dir) / "data") as server:
            yield server


@pytest.fixture
def coordinator() -> Iterator[CoordinatorProcess]:
    """A coordinator of the test's own: for the tests that kill it."""
    with _started() as server:
        yield server


@pytest.fixture(scope="module")
def shared() -> Iterator[CoordinatorProcess]:
    """One coordinator for the tests that leave it running (a start is ~2 CPU s); each test has its own experts."""
    with _started() as server:
        yield server


@pytest.fixture
def e(request) -> str:
    """The test's expert pushed through the proxy (and ``ref-<it>``, its reference pushed directly)."""
    return f"e-{request.node.name.split('[')[0][5:50]}"


def _setup(url: str, e: str = "e") -> tuple[dict[str, torch.Tensor], bytes]:
    """Experts ``e`` (pushed through the proxy) and ``ref-<e>`` (pushed directly), same start; the delta's bytes."""
    adapter = make_adapter(**ADAPTER)
    admin = CoordinatorClient(url)
    for name in (e, f"ref-{e}"):
        admin.experts.create(name, adapter, expert_spec(rank=16))
    delta = random_like(adapter, seed=3, scale=0.01)
    admin.updates.push(f"ref-{e}", dumps(delta), update_meta())
    return adapter, dumps(delta)


def _port(url: str) -> tuple[str, int]:
    return "127.0.0.1", int(url.rsplit(":", 1)[1])


def _assert_applied_once_like_ref(url: str, e: str = "e") -> None:
    admin = CoordinatorClient(url)
    info = admin.experts.get(e)
    assert info["updates_applied"] == 1 and info["version"] == 1
    got, want = admin.experts.pull(e).tensors, admin.experts.pull(f"ref-{e}").tensors
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_push_broken_at_90_percent_sends_only_the_rest_and_is_applied_once(shared, e) -> None:
    _, body = _setup(shared.url, e)
    cut_at = len(body) * 9 // 10
    with CutProxy(_port(shared.url), cut_at=cut_at) as proxy:
        client = CoordinatorClient(proxy.url(), token=local_token(shared.url), upload=FIXED_CHUNKS,
                                   retry=FAST_RETRY)
        status = client.updates.push(e, body, update_meta())
        after_cut, total = proxy.bytes_after_cut, proxy.bytes_to_target
    assert proxy.cuts == 1 and client.updates.last_upload.resumes == 1
    assert status["status"] == "applied"
    # Resuming sent the rest from the last acknowledged chunk: at most one chunk more than the bytes left.
    assert after_cut <= len(body) - cut_at + CHUNK + HEADERS
    assert total <= len(body) + CHUNK + 16 * HEADERS
    assert client.updates.last_upload.resent <= CHUNK
    _assert_applied_once_like_ref(shared.url, e)


def test_a_one_shot_push_broken_at_90_percent_sends_everything_again(shared, e) -> None:
    """The baseline the resumable path improves on (and what bodies under the threshold still do)."""
    _, body = _setup(shared.url, e)
    with CutProxy(_port(shared.url), cut_at=len(body) * 9 // 10) as proxy:
        client = CoordinatorClient(proxy.url(), token=local_token(shared.url), retry=FAST_RETRY)
        client.updates.push(e, body, update_meta())
        after_cut = proxy.bytes_after_cut
    assert client.updates.last_upload is None  # 2 MiB is under the default threshold (8 MiB): one request
    assert after_cut >= len(body)
    _assert_applied_once_like_ref(shared.url, e)


def test_acknowledged_chunks_survive_a_kill_9_of_the_coordinator(coordinator: CoordinatorProcess) -> None:
    """The coordinator dies (SIGKILL) mid-upload and restarts on its data dir: the client continues from the
    last acknowledged chunk, not from zero, and the update is applied once."""
    _, body = _setup(coordinator.url)
    proxy = CutProxy(_port(coordinator.url), cut_at=len(body) // 2)

    def crash_and_restart() -> None:
        coordinator.kill()
        coordinator.start()
        proxy.retarget(_port(coordinator.url))

    proxy.on_cut = crash_and_restart
    with proxy:
        client = CoordinatorClient(proxy.url(), token=local_token(coordinator.url), upload=FIXED_CHUNKS,
                                   retry=FAST_RETRY)
        client.updates.push("e", body, update_meta())
    assert proxy.cuts == 1 and client.updates.last_upload.resumes == 1
    assert proxy.bytes_after_cut <= len(body) - len(body) // 2 + CHUNK + HEADERS
    _assert_applied_once_like_ref(coordinator.url)


def test_a_coordinator_gone_for_good_fails_after_bounded_retries(coordinator: CoordinatorProcess) -> None:
    _, body = _setup(coordinator.url)
    proxy = CutProxy(_port(coordinator.url), cut_at=len(body) // 2)
    proxy.on_cut = coordinator.kill
    with proxy:
        client = CoordinatorClient(proxy.url(), token=local_token(coordinator.url), upload=FIXED_CHUNKS,
                                   retry=RetryPolicy(attempts=2, base_delay=0.01), timeout=(2.0, 10.0))
        with pytest.raises(Unavailable, match="gave up"):
            client.updates.push("e", body, update_meta())


# chunks over SPOOL_IN_MEMORY reach the application as the front's spool file, already hashed; the upload store
# copies that file in the kernel instead of reading the request body (coordinator/storage/upload_files.py)
SPOOLED_CHUNK = SPOOL_IN_MEMORY + (64 << 10)


def test_chunks_the_front_spooled_and_chunks_it_did_not_make_one_update_applied_once(shared, e) -> None:
    _, body = _setup(shared.url, e)
    policy = UploadPolicy(threshold=1, first_chunk=SPOOLED_CHUNK, min_chunk=SPOOLED_CHUNK, max_chunk=SPOOLED_CHUNK,
                          max_fraction=1.0)
    client = CoordinatorClient(shared.url, token=local_token(shared.url), upload=policy)
    client.updates.push(e, body, update_meta())
    stats = client.updates.last_upload
    assert stats.chunks == 2 and stats.resumes == 0  # one spooled chunk (1.06 MiB), one kept in memory (~0.94 MiB)
    _assert_applied_once_like_ref(shared.url, e)


def test_a_damaged_spooled_chunk_is_refused_and_the_next_one_starts_from_the_same_offset(shared, e) -> None:
    _, body = _setup(shared.url, e)
    token = local_token(shared.url)
    api, auth = f"{shared.url}/api/v1/experts/{e}/uploads", {"Authorization": f"Bearer {token}"}
    opened = requests.post(api, json={"update": update_meta(), "size": len(body), "digest": digest_header(body)},
                           headers=auth, timeout=30)
    assert opened.status_code == 201, opened.text
    upload = f"{api}/{opened.json()['upload_id']}"
    chunk = body[:SPOOLED_CHUNK]
    headers = auth | {"Content-Range": f"bytes 0-{len(chunk) - 1}/{len(body)}"}
    damaged = requests.put(upload, data=chunk, headers=headers | {"X-FedMoE-Digest": digest_header(b"other")},
                           timeout=30)
    assert damaged.status_code == 400 and damaged.json()["error"]["details"]["offset"] == 0, damaged.text
    assert requests.get(upload, headers=auth, timeout=30).json()["offset"] == 0
    good = requests.put(upload, data=chunk, headers=headers | {"X-FedMoE-Digest": digest_header(chunk)}, timeout=30)
    assert good.status_code == 200 and good.json()["offset"] == len(chunk), good.text
    rest = body[len(chunk):]
    tail = requests.put(upload, data=rest, timeout=30, headers=auth | {
        "Content-Range": f"bytes {len(chunk)}-{len(body) - 1}/{len(body)}", "X-FedMoE-Digest": digest_header(rest)})
    assert tail.status_code == 200, tail.text
    done = requests.post(f"{upload}/complete", headers=auth, timeout=30)
    assert done.status_code == 202, done.text
    _assert_applied_once_like_ref(shared.url, e)


def test_a_chunk_cut_short_mid_body_is_not_kept_and_the_upload_goes_on(shared, e) -> None:
    """The front writes a large chunk straight into the upload's file (coordinator/api/upload_placement.py); a client that
    goes away mid-body leaves nothing past the offset, and the upload is free for the next try at once."""
    _, body = _setup(shared.url, e)
    token = local_token(shared.url)
    api, auth = f"{shared.url}/api/v1/experts/{e}/uploads", {"Authorization": f"Bearer {token}"}
    opened = requests.post(api, json={"update": update_meta(), "size": len(body), "digest": digest_header(body)},
                           headers=auth, timeout=30)
    upload_id = opened.json()["upload_id"]
    chunk = body[:SPOOLED_CHUNK]
    head = (f"PUT /api/v1/experts/{e}/uploads/{upload_id} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Range: bytes 0-{len(chunk) - 1}/{len(body)}\r\nContent-Length: {len(chunk)}\r\n"
            f"X-FedMoE-Digest: {digest_header(chunk)}\r\n\r\n").encode()
    with socket.create_connection(_port(shared.url)) as sock:
        sock.sendall(head + chunk[:len(chunk) // 2])
    part = shared.data_dir / "uploads" / f"{upload_id}.part"
    upload = f"{api}/{upload_id}"
    assert requests.get(upload, headers=auth, timeout=30).json()["offset"] == 0
    deadline = time.monotonic() + 20  # the front sees the connection end, then releases the place: cut back to 0
    while part.stat().st_size and time.monotonic() < deadline:
        time.sleep(0.05)
    assert part.stat().st_size == 0
    headers = auth | {"Content-Range": f"bytes 0-{len(chunk) - 1}/{len(body)}", "X-FedMoE-Digest": digest_header(chunk)}
    good = requests.put(upload, data=chunk, headers=headers, timeout=30)  # waits for the cut one's release if need be
    assert good.status_code == 200 and good.json()["offset"] == len(chunk), good.text
    assert part.read_bytes() == chunk
    rest = body[len(chunk):]
    tail = requests.put(upload, data=rest, timeout=30, headers=auth | {
        "Content-Range": f"bytes {len(chunk)}-{len(body) - 1}/{len(body)}", "X-FedMoE-Digest": digest_header(rest)})
    assert tail.status_code == 200, tail.text
    assert requests.post(f"{upload}/complete", headers=auth, timeout=30).status_code == 202
    _assert_applied_once_like_ref(shared.url, e)
