"""Resumable uploads through a relay: the root's routes (coordinator/api/uploads.py) with the relay behind them.

A real relay app forwards over HTTP to a real root on a loopback port (fedasync, lr 1, no staleness
decay, lossless forwarding: the root's weights are w0 + the deltas, exactly). A finished upload must be
queued at the relay like a one-shot push (durable before its 202), forwarded once, and applied once
at the root; a retried finish, a one-shot push or a new upload of the same update id changes nothing.
"""
from __future__ import annotations

import pytest
import torch

from protocol.integrity import digest_header
from protocol.tensors import dumps
from protocol.uploads import UploadPolicy
from tests.coordinator.test_relay_exactly_once import make_relay, push, root_on_loopback, root_weights, token_at
from tests.coordinator.test_uploads import complete, error, open_upload, put_chunk
from tests.helpers import make_adapter, random_like, update_meta


@pytest.fixture
def root(tmp_path):
    with root_on_loopback(tmp_path) as served:
        yield served


def uploads_at(relay):
    return relay.extensions["fedmoe_uploads"]


def test_an_upload_through_a_relay_is_queued_forwarded_and_applied_once(root, tmp_path):
    root_app, _, admin, join = root
    relay = make_relay(root, tmp_path, "r1")
    service = relay.extensions["fedmoe"]
    try:
        w0 = root_weights(admin)
        delta = random_like(make_adapter(), 1)
        body, meta = dumps(delta), update_meta(num_samples=7, worker_id="wa")
        token = token_at(relay, join, "wa")
        worker = relay.test_client(token=token)
        opened = open_upload(worker, body, meta, expert="e1")
        assert opened.status_code == 201, opened.json
        upload_id, half = opened.json["upload_id"], len(body) // 2
        assert put_chunk(worker, upload_id, body, 0, half - 1, expert="e1").json["offset"] == half
        # the client lost the answer and sends the chunk again, or skips ahead: told where to continue
        assert error(put_chunk(worker, upload_id, body, 0, half - 1, expert="e1")) == (409, "conflict")
        gap = put_chunk(worker, upload_id, body, half + 1, len(body) - 1, expert="e1")
        assert gap.status_code == 416 and gap.json["error"]["details"]["offset"] == half
        assert worker.get(f"/api/v1/experts/e1/uploads/{upload_id}").json["offset"] == half
        early = complete(worker, upload_id, expert="e1")
        assert early.status_code == 409 and early.json["error"]["details"]["reason"] == "upload_incomplete"
        assert service.store.stats()["queued_updates"] == 0  # nothing queued before the finish
        assert put_chunk(worker, upload_id, body, half, len(body) - 1, expert="e1").json["offset"] == len(body)

        done = complete(worker, upload_id, expert="e1")
        assert done.status_code == 202 and done.json["status"] == "queued" and done.json["relay"] == "r1"
        assert service.store.stats()["queued_updates"] == 1
        assert not list(uploads_at(relay).root.glob("*.part"))  # the body now lives in the relay's blob store
        again = complete(worker, upload_id, expert="e1")
        assert again.status_code == 200 and again.json == done.json  # a retried finish
        assert push(relay, token, delta, meta["update_id"], 7, "wa").status_code == 200  # one-shot: a duplicate
        reopened = open_upload(worker, body, meta, expert="e1")
        assert reopened.status_code == 200 and reopened.json["complete"] and reopened.json["upload_id"] is None

        assert service.forwarder.forward_once() == 1
        assert service.forwarder.forward_once() == 0
        info = admin.experts.get("e1")
        assert (info["version"], info["updates_applied"], info["samples_seen"]) == (1, 1, 7)
        got = root_weights(admin)
        for k in w0:
            assert torch.allclose(got[k], w0[k] + delta[k], atol=1e-6), k
        at_root = root_app.extensions["fedmoe"].update_status(meta["update_id"])
        assert at_root["relayed_in"].startswith("r1.") and at_root["status"] == "applied"
        assert service.update_status(meta["update_id"])["status"] == "forwarded"
    finally:
        service.close()


def test_a_relay_restarted_mid_upload_continues_from_the_acknowledged_offset(root, tmp_path):
    _, _, admin, join = root
    delta = random_like(make_adapter(), 2)
    body, meta = dumps(delta), update_meta(num_samples=3, worker_id="wa")
    relay = make_relay(root, tmp_path, "r1")
    token = token_at(relay, join, "wa")
    try:
        worker = relay.test_client(token=token)
        upload_id = open_upload(worker, body, meta, expert="e1").json["upload_id"]
        third = len(body) // 3
        assert put_chunk(worker, upload_id, body, 0, third - 1, expert="e1").json["offset"] == third
    finally:
        relay.extensions["fedmoe"].close()
    relay = make_relay(root, tmp_path, "r1")  # the same data dir: its tokens, queue and uploads
    service = relay.extensions["fedmoe"]
    try:
        worker = relay.test_client(token=token)
        assert worker.get(f"/api/v1/experts/e1/uploads/{upload_id}").json["offset"] == third
        assert put_chunk(worker, upload_id, body, third, len(body) - 1, expert="e1").status_code == 200
        assert complete(worker, upload_id, expert="e1").status_code == 202
        assert service.forwarder.forward_once() == 1
        info = admin.experts.get("e1")
        assert (info["updates_applied"], info["samples_seen"]) == (1, 3)
    finally:
        service.close()


def test_bad_uploads_at_a_relay_are_4xx_json_and_queue_nothing(root, tmp_path):
    _, _, _, join = root
    relay = make_relay(root, tmp_path, "r1")
    service = relay.extensions["fedmoe"]
    try:
        worker = relay.test_client(token=token_at(relay, join, "wa"))
        other = relay.test_client(token=token_at(relay, join, "wb"))
        admin = relay.test_client(token=relay.extensions["fedmoe_auth"].admin_token)
        body = dumps(random_like(make_adapter(), 3))
        meta = update_meta(worker_id="wa")
        assert error(open_upload(worker, body, meta, expert="e2")) == (403, "forbidden")  # its token is for e1
        assert error(open_upload(admin, body, update_meta(), expert="nope")) == (404, "not_found")
        assert error(open_upload(worker, body, update_meta(worker_id="wb"), expert="e1")) == (403, "forbidden")
        members = update_meta(worker_id="wa", members={"x1": "b3-" + "0" * 64})
        assert error(open_upload(worker, body, members, expert="e1"))[0] == 403  # only a relay's batch has members
        for bad in ({"size": 0}, {"size": "12"}, {"digest": "md5=abc"}, {"update": "u1"}):
            r = open_upload(worker, body, meta, expert="e1", **bad)
            assert r.status_code == 400 and r.json["error"]["code"] == "bad_request", (bad, r.json)
        too_big = open_upload(worker, body, meta, expert="e1", size=service.config.max_body_bytes + 1)
        assert error(too_big) == (413, "payload_too_large")

        upload_id = open_upload(worker, body, meta, expert="e1").json["upload_id"]
        assert error(other.get(f"/api/v1/experts/e1/uploads/{upload_id}")) == (404, "not_found")  # not its upload
        assert error(worker.put(f"/api/v1/experts/e1/uploads/{upload_id}", data=body[:10],
                                headers={"Content-Range": "bytes 0-9"})) == (400, "bad_request")
        assert error(put_chunk(worker, upload_id, body, 0, 9, expert="e1",
                               **{"X-FedMoE-Digest": digest_header(b"other")}))[0] == 400

        # the body does not match the digest it was opened with: dropped at the finish, nothing queued
        wrong = open_upload(worker, body, update_meta(worker_id="wa"), expert="e1",
                            digest=digest_header(body[::-1])).json["upload_id"]
        put_chunk(worker, wrong, body, 0, len(body) - 1, expert="e1")
        assert error(complete(worker, wrong, expert="e1"))[0] == 422
        assert error(worker.get(f"/api/v1/experts/e1/uploads/{wrong}")) == (404, "not_found")

        # a NaN update is refused at the finish as a one-shot push would be, and the upload dropped
        nan = random_like(make_adapter(), 4)
        next(iter(nan.values()))[0, 0] = float("nan")
        nan_body = dumps(nan)
        nan_id = open_upload(worker, nan_body, update_meta(worker_id="wa"), expert="e1").json["upload_id"]
        put_chunk(worker, nan_id, nan_body, 0, len(nan_body) - 1, expert="e1")
        assert complete(worker, nan_id, expert="e1").status_code in (400, 422)
        assert error(worker.get(f"/api/v1/experts/e1/uploads/{nan_id}")) == (404, "not_found")
        assert service.store.stats()["queued_updates"] == 0
    finally:
        service.close()


def test_an_upload_the_relay_queue_cannot_hold_is_refused_at_open_with_507(root, tmp_path):
    _, _, _, join = root
    relay = make_relay(root, tmp_path, "r1", max_queue_mb=0.0001)  # 104 bytes
    try:
        worker = relay.test_client(token=token_at(relay, join, "wa"))
        body = dumps(random_like(make_adapter(), 5))
        full = open_upload(worker, body, update_meta(worker_id="wa"), expert="e1")
        assert error(full) == (507, "insufficient_storage") and "--max-queue-mb" in full.json["error"]["message"]
        assert uploads_at(relay).open_count() == 0
    finally:
        relay.extensions["fedmoe"].close()


def test_an_upload_finished_after_a_one_shot_push_of_the_same_update_is_its_duplicate(root, tmp_path):
    """The one-shot push (BLAKE3) is queued while an upload of the same update (SHA-256) is open: finishing the
    upload compares the body in the queued update's digest algorithm and answers as to a retry."""
    _, _, admin, join = root
    relay = make_relay(root, tmp_path, "r1")
    service = relay.extensions["fedmoe"]
    try:
        token = token_at(relay, join, "wa")
        worker = relay.test_client(token=token)
        delta = random_like(make_adapter(), 6)
        body, meta = dumps(delta), update_meta(num_samples=4, worker_id="wa")
        upload_id = open_upload(worker, body, meta, expert="e1", digest=digest_header(body, "sha256")).json["upload_id"]
        put_chunk(worker, upload_id, body, 0, len(body) - 1, expert="e1")
        assert push(relay, token, delta, meta["update_id"], 4, "wa").status_code == 202
        finished = complete(worker, upload_id, expert="e1")
        assert finished.status_code == 200 and finished.json["status"] == "queued", finished.json
        other = dumps(random_like(make_adapter(), 7))  # a different body under that id is refused at the open
        assert error(open_upload(worker, other, meta, expert="e1")) == (409, "conflict")
        assert service.forwarder.forward_once() == 1
        assert admin.experts.get("e1")["samples_seen"] == 4
    finally:
        service.close()


def test_a_relay_forwards_a_large_batch_as_an_upload_and_one_refused_for_a_member_is_superseded(root, tmp_path):
    """Upstream, the relay's batches of at least ``UploadPolicy.threshold`` bytes go through the root's upload
    routes (the forwarder pushes with client.updates.push); a 409 members_applied at the finish drops
    the root's upload and the relay re-sends the rest, as for a one-shot batch."""
    root_app, _, admin, join = root
    relay = make_relay(root, tmp_path, "r1")
    service = relay.extensions["fedmoe"]
    service.upstream.updates.policy = UploadPolicy(threshold=1, first_chunk=256, min_chunk=256, max_chunk=256)
    try:
        w0 = root_weights(admin)
        d1, d2 = random_like(make_adapter(), 8), random_like(make_adapter(), 9)
        token = token_at(relay, join, "wa")
        assert push(relay, token, d1, "U1", 3, "wa").status_code == 202
        assert push(relay, token, d2, "U2", 4, "wa").status_code == 202
        assert push(root_app, token_at(root_app, join, "wa"), d2, "U2", 4, "wa").status_code == 202  # failed over
        assert service.forwarder.forward_once() == 1  # {U1, U2} refused at the finish for U2; {U1} sent
        assert service.upstream.updates.last_upload is not None and service.upstream.updates.last_upload.chunks > 1
        assert service.update_status("U2")["status"] == "applied_elsewhere"
        info = admin.experts.get("e1")
        assert (info["updates_applied"], info["samples_seen"]) == (2, 7)
        got = root_weights(admin)
        for k in w0:
            assert torch.allclose(got[k], w0[k] + d1[k] + d2[k], atol=1e-6), k
        root_uploads = root_app.extensions["fedmoe_uploads"]
        assert root_uploads.open_count() == 0 and not list(root_uploads.root.glob("*.part"))
    finally:
        service.close()
