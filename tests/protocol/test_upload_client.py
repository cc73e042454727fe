"""The resumable push client (protocol/uploads.py) against a real coordinator served in this process."""
from __future__ import annotations

import os
import threading

import pytest
import requests
from werkzeug.serving import make_server

from bench.common import running_coordinator
from coordinator.api.app import create_app
from coordinator.config import CoordinatorConfig
from bench.wanemu.cut import CutProxy
from protocol.client import CoordinatorClient, RetryPolicy
from protocol.credentials import local_token
from protocol.errors import NotFound
from protocol.tensors import dumps
from protocol.integrity import digest_header
from protocol.uploads import PREFIX_DIGEST_HEADER, SNAPSHOT, ResumablePush, UploadPolicy
from tests.helpers import expert_spec, make_adapter, random_like, serve_on_loopback, update_meta

ADAPTER = make_adapter(rank=8, d_in=256, d_out=256, layers=4)  # 128 KiB
CHUNK = 16 << 10
FIXED = UploadPolicy(threshold=64 << 10, first_chunk=CHUNK, min_chunk=CHUNK, max_chunk=CHUNK)
FAST_RETRY = RetryPolicy(attempts=4, base_delay=0.01)


@pytest.fixture
def url():
    with running_coordinator(gateway_interval=3600) as url:
        CoordinatorClient(url).experts.create("e", ADAPTER, expert_spec(rank=8))
        yield url


def _port(url: str) -> tuple[str, int]:
    return "127.0.0.1", int(url.rsplit(":", 1)[1])


def test_bodies_under_the_threshold_go_in_one_request_and_larger_ones_in_chunks(url):
    first, second = dumps(random_like(ADAPTER, 1, scale=0.01)), dumps(random_like(ADAPTER, 2, scale=0.01))
    one_shot = CoordinatorClient(url, upload=UploadPolicy(threshold=len(first) + 1))
    assert one_shot.updates.push("e", first, update_meta())["status"] == "applied"
    assert one_shot.updates.last_upload is None
    chunked = CoordinatorClient(url, upload=FIXED)
    assert chunked.updates.push("e", second, update_meta(base_version=1))["status"] == "applied"
    assert chunked.updates.last_upload.chunks == -(-len(second) // CHUNK) and chunked.updates.last_upload.resent == 0
    assert CoordinatorClient(url).experts.get("e")["updates_applied"] == 2


def test_a_break_mid_chunk_on_the_threaded_server_resumes_from_the_last_chunk(url):
    body = dumps(random_like(ADAPTER, 2, scale=0.01))
    with CutProxy(_port(url), cut_at=len(body) // 2) as proxy:
        client = CoordinatorClient(proxy.url(), token=local_token(url), upload=FIXED, retry=FAST_RETRY)
        client.updates.push("e", body, update_meta())
    assert client.updates.last_upload.resumes == 1 and client.updates.last_upload.resent <= CHUNK
    assert CoordinatorClient(url).experts.get("e")["updates_applied"] == 1


def test_an_upload_that_expired_mid_push_is_opened_again_and_applied_once(tmp_path):
    """The coordinator's upload expires while the link is down: the client opens it again under the same
    update_id, sends it all again, and it is applied once."""
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "data", gateway_interval=3600, auth=False))
    store, now = app.extensions["fedmoe_uploads"], [1000.0]
    store.clock = lambda: now[0]
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        CoordinatorClient(url).experts.create("e", ADAPTER, expert_spec(rank=8))
        body, meta = dumps(random_like(ADAPTER, 2, scale=0.01)), update_meta()

        def link_down_for_an_hour() -> None:
            now[0] += store.limits.idle_seconds + 1

        with CutProxy(_port(url), cut_at=len(body) // 2, on_cut=link_down_for_an_hour) as proxy:
            client = CoordinatorClient(proxy.url(), upload=FIXED, retry=FAST_RETRY)
            status = client.updates.push("e", body, meta)
        assert status["status"] == "applied" and client.updates.last_upload.reopened == 1
        assert client.updates.last_upload.sent >= len(body) + len(body) // 2 - 2 * CHUNK  # started over after the break
        info = CoordinatorClient(url).experts.get("e")
        assert (info["version"], info["updates_applied"]) == (1, 1)
        assert store.open_count() == 0 and not list(store.root.glob("*.part"))  # the expired one was swept
    finally:
        server.shutdown()
        server.server_close()
        app.extensions["fedmoe"].close()


def test_a_push_already_recorded_sends_no_chunk(url):
    body, meta = dumps(random_like(ADAPTER, 2, scale=0.01)), update_meta()
    client = CoordinatorClient(url, upload=FIXED)
    first = client.updates.push("e", body, meta)
    again = client.updates.push("e", body, meta)  # e.g. a restarted worker pushing its pending update again
    assert again["update_id"] == first["update_id"] and client.updates.last_upload.sent == 0
    assert CoordinatorClient(url).experts.get("e")["updates_applied"] == 1


def test_upload_policy_checks_its_settings():
    with pytest.raises(ValueError, match="min_chunk"):
        UploadPolicy(min_chunk=8, first_chunk=4, max_chunk=16)
    with pytest.raises(ValueError, match="max_fraction"):
        UploadPolicy(max_fraction=0)


def test_a_coordinator_without_upload_routes_gets_a_one_shot_push(tmp_path):
    """An older coordinator (or a relay) answers the upload routes 404: the client pushes in one request."""
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "data", gateway_interval=3600, auth=False))

    def older(environ, start_response):
        if "/uploads" in environ["PATH_INFO"]:  # as Flask answers a route it does not have
            start_response("404 NOT FOUND", [("Content-Type", "application/json")])
            return [b'{"error": {"code": "not_found", "message": "The requested URL was not found"}}']
        return app(environ, start_response)

    server = make_server("127.0.0.1", 0, older, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        CoordinatorClient(url).experts.create("e", ADAPTER, expert_spec(rank=8))
        client = CoordinatorClient(url, upload=FIXED)
        assert client.updates.push("e", dumps(random_like(ADAPTER, 2, scale=0.01)), update_meta())["status"] == "applied"
        assert client.updates.last_upload.chunks == 0
        with pytest.raises(NotFound, match="no expert named 'nope'"):  # a real 404 stays one
            client.updates.push("nope", dumps(random_like(ADAPTER, 2)), update_meta())
    finally:
        server.shutdown()
        server.server_close()
        app.extensions["fedmoe"].close()


@pytest.fixture
def crowded(tmp_path):
    """(app, URL, join token) of a real coordinator served on loopback that holds at most 2 open uploads in all."""
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "data", gateway_interval=3600,
                                       extra={"MAX_OPEN_UPLOADS": 2}))
    server, url = serve_on_loopback(app)
    try:
        CoordinatorClient(url, token=app.extensions["fedmoe_auth"].admin_token).experts.create(
            "e", ADAPTER, expert_spec(rank=8))
        yield app, url, (tmp_path / "data" / "join_token").read_text().strip()
    finally:
        server.shutdown()
        server.server_close()
        app.extensions["fedmoe"].close()


def _register(url: str, join: str, worker_id: str) -> str:
    r = requests.post(f"{url}/api/v1/workers", headers={"Authorization": f"Bearer {join}"}, timeout=30,
                      json={"worker_id": worker_id, "specialty": "e", "base_model": expert_spec(rank=8)["base_model"]})
    assert r.status_code == 200, r.text
    return r.json()["token"]


def _open_empty(url: str, token: str, worker_id: str) -> str:
    """An upload opened by ``worker_id`` that never receives a byte; its id."""
    r = requests.post(f"{url}/api/v1/experts/e/uploads", headers={"Authorization": f"Bearer {token}"}, timeout=30,
                      json={"update": update_meta(worker_id=worker_id), "size": 1 << 20, "digest": "sha256=" + "0" * 64})
    assert r.status_code == 201, r.text
    return r.json()["upload_id"]


def test_an_open_refused_at_the_limit_of_open_uploads_falls_back_to_a_one_shot_push(crowded):
    """Issue 30.2: a 507 to the open (no room for an upload) blocked every push of 8 MiB or more; the client now
    pushes such an update in one request, and it is applied."""
    app, url, join = crowded
    worker = CoordinatorClient(url, token=_register(url, join, "w1"), upload=FIXED, retry=FAST_RETRY)
    for other in ("w2", "w3"):  # the two open uploads the coordinator holds, both fresh: neither may be evicted
        _open_empty(url, _register(url, join, other), other)
    body = dumps(random_like(ADAPTER, 3, scale=0.01))
    status = worker.updates.push("e", body, update_meta(worker_id="w1"))
    assert status["status"] == "applied" and worker.updates.last_upload.chunks == 0  # no chunk: one request
    assert CoordinatorClient(url, token=app.extensions["fedmoe_auth"].admin_token).experts.get("e")["updates_applied"] == 1


def test_an_open_refused_for_the_workers_own_limit_falls_back_to_a_one_shot_push(crowded):
    """The worker's two uploads are both receiving chunks (their locks held): the third open is a 409
    too_many_uploads, which the client answers with a push in one request."""
    app, url, join = crowded
    token = _register(url, join, "w1")
    worker = CoordinatorClient(url, token=token, upload=FIXED, retry=FAST_RETRY)
    store = app.extensions["fedmoe_uploads"]
    held = [store.get(_open_empty(url, token, "w1"), "e", "w1") for _ in range(2)]
    for upload in held:
        upload.lock.acquire()  # as a chunk arriving holds it (UploadStore.place_chunk)
    try:
        status = worker.updates.push("e", dumps(random_like(ADAPTER, 4, scale=0.01)), update_meta(worker_id="w1"))
    finally:
        for upload in held:
            upload.lock.release()
    assert status["status"] == "applied" and worker.updates.last_upload.chunks == 0


class _FakeCoordinator:
    """Answers a ResumablePush's calls like a coordinator that takes every chunk; records each chunk's headers."""

    def __init__(self, prefix_digests: bool) -> None:
        self.prefix_digests, self.offset, self.chunks = prefix_digests, 0, []

    def __call__(self, method: str, path: str, attempts=None, **kwargs):
        class Answer:
            def __init__(self, payload):
                self.payload = payload

            def json(self):
                return self.payload

        if path.endswith("/uploads"):
            opened = {"upload_id": "u" * 32, "offset": 0}
            return Answer(opened | ({"prefix_digests": True} if self.prefix_digests else {}))
        if path.endswith("/complete"):
            return Answer({"status": "recorded"})
        self.chunks.append((self.offset, bytes(kwargs["data"]), kwargs["headers"]))
        self.offset += len(kwargs["data"])
        return Answer({"offset": self.offset})


@pytest.mark.parametrize("prefix_digests", [True, False])
def test_each_chunk_is_checked_by_the_digest_of_the_body_up_to_its_end_when_offered(prefix_digests):
    """Offered (prefix_digests): the digest of body[:end] from the snapshots the body digest's pass kept, and large
    chunks end on a snapshot; not offered (a coordinator before it): each chunk's own digest, as before."""
    body = os.urandom(9 * SNAPSHOT + 12345)
    fake = _FakeCoordinator(prefix_digests)
    large = 4 * SNAPSHOT + 1000  # large chunks are cut to end on a snapshot
    policy = UploadPolicy(threshold=1, first_chunk=large, min_chunk=1 << 20, max_chunk=large, max_fraction=1.0)
    push = ResumablePush(fake, "e", body, update_meta(), policy, attempts=2, backoff=lambda _: 0.0)
    assert push.run() == {"status": "recorded"}
    assert b"".join(chunk for _, chunk, _ in fake.chunks) == body
    for offset, chunk, headers in fake.chunks:
        end = offset + len(chunk)
        if prefix_digests:
            assert headers[PREFIX_DIGEST_HEADER] == digest_header(body[:end]) and "X-FedMoE-Digest" not in headers
            assert end % SNAPSHOT == 0 or end == len(body)  # cut to end on a snapshot: no hashing for its check
        else:
            assert headers["X-FedMoE-Digest"] == digest_header(chunk) and PREFIX_DIGEST_HEADER not in headers
    assert [len(chunk) for _, chunk, _ in fake.chunks] == [4 * SNAPSHOT, 4 * SNAPSHOT, SNAPSHOT + 12345]
