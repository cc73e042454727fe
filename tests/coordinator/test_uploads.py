"""Resumable uploads (coordinator/api/uploads.py): every bad request, the bounds, restarts, exactly-once."""
from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from protocol.integrity import digest_header
import torch

from protocol.tensors import dumps, load_file
from tests.helpers import FINGERPRINT, make_adapter, push, put_expert, random_like, relay_join_token, update_meta

ADAPTER = make_adapter(layers=4, d_in=64, d_out=64)  # ~33 KiB body
BASE = {"id": "tiny-test", "fingerprint": FINGERPRINT}


def body_of(seed: int = 1) -> bytes:
    return dumps(random_like(ADAPTER, seed))


def sha(data: bytes, algorithm: str = "blake3") -> str:
    """The whole-body digest as today's client sends it (BLAKE3; coordinators also take sha256)."""
    return digest_header(data, algorithm)


def open_upload(client, body: bytes, meta: dict | None = None, expert: str = "e", **overrides):
    payload = {"update": meta or update_meta(), "size": len(body), "digest": sha(body)} | overrides
    return client.post(f"/api/v1/experts/{expert}/uploads", json=payload)


def put_chunk(client, upload_id: str, body: bytes, start: int, end: int, expert: str = "e", **headers):
    """Send body[start:end + 1] as bytes start-end/len(body)."""
    return client.put(f"/api/v1/experts/{expert}/uploads/{upload_id}", data=body[start:end + 1],
                      headers={"Content-Range": f"bytes {start}-{end}/{len(body)}", **headers})


def complete(client, upload_id: str, expert: str = "e"):
    return client.post(f"/api/v1/experts/{expert}/uploads/{upload_id}/complete")


def error(response) -> tuple[int, str]:
    return response.status_code, response.get_json()["error"]["code"]


def register(app, worker_id: str, specialty: str = "e") -> str:
    join = (app.extensions["fedmoe"].config.data_dir / "join_token").read_text().strip()
    r = app.test_client(token=join).post("/api/v1/workers",
                                         json={"worker_id": worker_id, "specialty": specialty, "base_model": BASE})
    assert r.status_code == 200, r.get_json()
    return r.get_json()["token"]


@pytest.fixture
def app(make_app):
    app = make_app(gateway_interval=3600)
    assert put_expert(app.test_client(), "e", ADAPTER).status_code == 201
    return app


@pytest.fixture
def client(app):
    return app.test_client()


def uploaded(client, body: bytes, meta: dict | None = None) -> str:
    """An upload with every byte received, in two chunks; its id."""
    r = open_upload(client, body, meta)
    assert r.status_code == 201, r.get_json()
    upload_id, half = r.get_json()["upload_id"], len(body) // 2
    assert put_chunk(client, upload_id, body, 0, half - 1).get_json()["offset"] == half
    assert put_chunk(client, upload_id, body, half, len(body) - 1).get_json()["offset"] == len(body)
    return upload_id


def test_chunks_then_complete_apply_the_update_once_as_a_push_would(make_app, client):
    body, meta = body_of(), update_meta()
    upload_id = uploaded(client, body, meta)
    r = complete(client, upload_id)
    assert r.status_code == 202 and r.get_json()["status"] == "applied"
    assert complete(client, upload_id).get_json() == r.get_json()  # a retried finish: the same answer, 200
    assert complete(client, upload_id).status_code == 200
    assert push(client, "e", None, meta, body=body).status_code == 200  # the same update id one-shot: a duplicate
    info = client.get("/api/v1/experts/e").get_json()
    assert (info["version"], info["updates_applied"]) == (1, 1)
    # the same bytes pushed one-shot to another coordinator give the same weights
    other = make_app(data_dir=Path(client.application.extensions["fedmoe"].config.data_dir).parent / "other",
                     gateway_interval=3600).test_client()
    assert put_expert(other, "e", ADAPTER).status_code == 201
    assert push(other, "e", None, update_meta(), body=body).status_code == 202
    ours, theirs = (c.get("/api/v1/experts/e/weights").data for c in (client, other))
    assert ours == theirs


def test_opening_again_finds_the_open_upload_and_its_offset(client):
    body, meta = body_of(), update_meta()
    first = open_upload(client, body, meta).get_json()
    put_chunk(client, first["upload_id"], body, 0, 999)
    again = open_upload(client, body, meta)
    assert again.status_code == 200 and again.get_json()["upload_id"] == first["upload_id"]
    assert again.get_json()["offset"] == 1000
    status = client.get(f"/api/v1/experts/e/uploads/{first['upload_id']}")
    assert status.get_json()["offset"] == 1000 and status.headers["X-FedMoE-Upload-Offset"] == "1000"
    head = client.head(f"/api/v1/experts/e/uploads/{first['upload_id']}")
    assert head.status_code == 200 and head.headers["X-FedMoE-Upload-Offset"] == "1000"
    assert error(open_upload(client, body_of(2), meta)) == (409, "conflict")  # same update_id, other bytes


def test_an_upload_with_a_sha256_digest_completes_like_a_blake3_one(client):
    body = body_of()
    upload_id = open_upload(client, body, digest=sha(body, "sha256")).get_json()["upload_id"]
    assert put_chunk(client, upload_id, body, 0, len(body) - 1, **{"X-FedMoE-Digest": sha(body, "sha256")}).status_code == 200
    assert complete(client, upload_id).status_code == 202


def test_opening_an_update_already_recorded_sends_nothing(client):
    body, meta = body_of(), update_meta()
    assert push(client, "e", None, meta, body=body).status_code == 202
    r = open_upload(client, body, meta)
    assert r.status_code == 200 and r.get_json()["update"]["status"] == "applied"
    assert r.get_json()["upload_id"] is None
    assert error(open_upload(client, body_of(2), meta)) == (409, "conflict")


@pytest.mark.parametrize("payload, code", [
    ({"update": None}, 400),  # no update metadata
    ({"update": {"update_id": "u"}, "size": 10, "digest": "sha256=" + "0" * 64}, 400),  # incomplete metadata
    ({"update": "META", "size": 10, "digest": "sha256=" + "0" * 64}, 400),
    ({"size": 0}, 400), ({"size": -5}, 400), ({"size": "10"}, 400), ({"size": True}, 400),
    ({"digest": "md5=abc"}, 400), ({"digest": None}, 400),
    ({"size": (1 << 30) + 1}, 413),  # over --max-body-mb, as a push
])
def test_bad_opens_are_4xx_and_record_nothing(app, client, payload, code):
    body = body_of()
    r = client.post("/api/v1/experts/e/uploads", json={"update": update_meta(), "size": len(body),
                                                       "digest": sha(body)} | payload)
    assert r.status_code == code and r.get_json()["error"]["message"]
    assert app.extensions["fedmoe_uploads"].open_count() == 0
    assert list((app.extensions["fedmoe"].config.data_dir / "uploads").iterdir()) == []


def test_not_json_and_unknown_expert(client):
    assert error(client.post("/api/v1/experts/e/uploads", data=b"x")) == (400, "bad_request")
    assert error(open_upload(client, body_of(), expert="nope")) == (404, "not_found")


def test_chunks_out_of_order_overlapping_or_malformed_are_refused_with_the_offset(client):
    body = body_of()
    upload_id = open_upload(client, body).get_json()["upload_id"]
    assert put_chunk(client, upload_id, body, 0, 99).status_code == 200
    overlap = put_chunk(client, upload_id, body, 50, 149)
    assert error(overlap) == (409, "conflict") and overlap.get_json()["error"]["details"]["offset"] == 100
    gap = put_chunk(client, upload_id, body, 200, 299)
    assert error(gap) == (416, "range_not_satisfiable") and gap.get_json()["error"]["details"]["offset"] == 100
    past = client.put(f"/api/v1/experts/e/uploads/{upload_id}", data=b"x" * 10,
                      headers={"Content-Range": f"bytes {len(body)}-{len(body) + 9}/{len(body)}"})
    assert error(past)[0] in (400, 416)
    url = f"/api/v1/experts/e/uploads/{upload_id}"
    for headers, data in [({}, b"x"),  # no Content-Range
                          ({"Content-Range": "bytes=100-"}, b"x"),
                          ({"Content-Range": "bytes 100-199/5"}, b"x" * 100),  # wrong total size
                          ({"Content-Range": "bytes 100-99/%d" % len(body)}, b""),  # ends before it starts
                          ({"Content-Range": "bytes 100-199/%d" % len(body)}, b"x" * 50),  # length != range
                          ({"Content-Range": "bytes 100-199/%d" % len(body), "X-FedMoE-Digest": "sha1=00"},
                           body[100:200])]:
        assert error(client.put(url, data=data, headers=headers))[0] == 400, headers
    assert client.get(url).get_json()["offset"] == 100  # none of it was taken


def test_a_damaged_chunk_is_refused_and_nothing_of_it_is_kept(app, client):
    body = body_of()
    upload_id = open_upload(client, body).get_json()["upload_id"]
    r = put_chunk(client, upload_id, body, 0, 999, **{"X-FedMoE-Digest": sha(b"something else")})
    assert error(r) == (400, "bad_request") and r.get_json()["error"]["details"]["offset"] == 0
    part = app.extensions["fedmoe"].config.data_dir / "uploads" / f"{upload_id}.part"
    assert part.stat().st_size == 0
    assert put_chunk(client, upload_id, body, 0, 999, **{"X-FedMoE-Digest": sha(body[:1000])}).status_code == 200
    assert part.stat().st_size == 1000


def test_complete_needs_every_byte_and_the_right_digest(client):
    body, meta = body_of(), update_meta()
    upload_id = open_upload(client, body, meta).get_json()["upload_id"]
    put_chunk(client, upload_id, body, 0, 99)
    early = complete(client, upload_id)
    assert error(early) == (409, "conflict") and early.get_json()["error"]["details"]["offset"] == 100
    # every byte, but not the ones the upload was opened with: 422, dropped, nothing recorded
    meta2 = update_meta()
    damaged = body[:-1] + bytes([body[-1] ^ 1])
    upload_id = open_upload(client, body, meta2).get_json()["upload_id"]
    put_chunk(client, upload_id, damaged, 0, len(body) - 1)
    r = complete(client, upload_id)
    assert error(r) == (422, "invalid_update") and r.get_json()["error"]["details"]["reason"] == "digest_mismatch"
    assert error(client.get(f"/api/v1/experts/e/uploads/{upload_id}")) == (404, "not_found")
    assert error(client.get(f"/api/v1/updates/{meta2['update_id']}")) == (404, "not_found")


def test_an_update_the_push_path_refuses_is_refused_the_same_way_and_audited(app, client):
    wrong = dumps(make_adapter(layers=4, d_in=64, d_out=32))  # shapes that do not fit the expert
    meta = update_meta()
    upload_id = uploaded(client, wrong, meta)
    r = complete(client, upload_id)
    one_shot = push(client, "e", None, update_meta(), body=wrong)
    assert error(r) == error(one_shot) == (422, "invalid_update")
    assert error(client.get(f"/api/v1/experts/e/uploads/{upload_id}")) == (404, "not_found")  # dropped
    events = client.get("/api/v1/events?kind=update_rejected").get_json()["events"]
    assert any(e["update_id"] == meta["update_id"] for e in events)
    assert client.get("/api/v1/experts/e").get_json()["updates_applied"] == 0


def test_an_upload_belongs_to_the_worker_that_opened_it(app):
    w1, w2 = (app.test_client(token=register(app, w)) for w in ("w1", "w2"))
    body = body_of()
    upload_id = open_upload(w1, body, update_meta()).get_json()["upload_id"]
    for r in (w2.get(f"/api/v1/experts/e/uploads/{upload_id}"), put_chunk(w2, upload_id, body, 0, 9),
              complete(w2, upload_id), w2.delete(f"/api/v1/experts/e/uploads/{upload_id}")):
        assert error(r) == (404, "not_found")
    assert error(open_upload(w1, body, update_meta(worker_id="w2"))) == (403, "forbidden")
    other_expert = app.test_client(token=register(app, "w3", "f"))
    assert error(other_expert.get(f"/api/v1/experts/e/uploads/{upload_id}")) == (403, "forbidden")
    assert error(app.test_client(token=None).get(f"/api/v1/experts/e/uploads/{upload_id}")) == (401, "unauthorized")
    assert put_chunk(w1, upload_id, body, 0, len(body) - 1).status_code == 200
    r = complete(w1, upload_id)
    assert r.status_code == 202
    assert app.test_client().get(f"/api/v1/updates/{r.get_json()['update_id']}").status_code == 200


def test_a_worker_holds_a_bounded_number_of_uploads_and_the_oldest_goes(make_app):
    app = make_app(gateway_interval=3600, extra={"UPLOADS_PER_WORKER": 2})
    assert put_expert(app.test_client(), "e", ADAPTER).status_code == 201
    worker = app.test_client(token=register(app, "w1"))
    store, now = app.extensions["fedmoe_uploads"], [1000.0]
    store.clock = lambda: now[0]
    ids = []
    for i in range(3):
        now[0] += 1
        ids.append(open_upload(worker, body_of(i)).get_json()["upload_id"])
    assert error(worker.get(f"/api/v1/experts/e/uploads/{ids[0]}")) == (404, "not_found")
    assert all(worker.get(f"/api/v1/experts/e/uploads/{i}").status_code == 200 for i in ids[1:])
    assert sorted(p.stem for p in store.root.glob("*.json")) == sorted(ids[1:])
    assert open_upload(app.test_client(token=register(app, "w2")), body_of(9)).status_code == 201  # per worker


def test_idle_uploads_expire_and_their_files_are_removed(make_app):
    app = make_app(gateway_interval=3600, extra={"UPLOAD_IDLE_SECONDS": 60})
    client = app.test_client()
    assert put_expert(client, "e", ADAPTER).status_code == 201
    store, now = app.extensions["fedmoe_uploads"], [1000.0]
    store.clock = lambda: now[0]
    body = body_of()
    idle = open_upload(client, body).get_json()["upload_id"]
    busy = open_upload(client, body_of(2)).get_json()["upload_id"]
    put_chunk(client, idle, body, 0, 99)
    now[0] += 50
    put_chunk(client, busy, body_of(2), 0, 99)  # a chunk keeps an upload alive
    now[0] += 20
    assert error(client.get(f"/api/v1/experts/e/uploads/{idle}")) == (404, "not_found")  # expired: gone at once
    assert (store.root / f"{idle}.part").exists()  # a read never writes: its files wait for the next sweep
    open_upload(client, body_of(3))  # opening sweeps
    assert error(client.get(f"/api/v1/experts/e/uploads/{idle}")) == (404, "not_found")
    assert not (store.root / f"{idle}.part").exists() and not (store.root / f"{idle}.json").exists()
    assert client.get(f"/api/v1/experts/e/uploads/{busy}").get_json()["offset"] == 100


def test_a_restart_keeps_open_uploads_at_their_acknowledged_offset(make_app):
    app = make_app(gateway_interval=3600)
    client = app.test_client()
    assert put_expert(client, "e", ADAPTER).status_code == 201
    body, meta = body_of(), update_meta()
    upload_id = open_upload(client, body, meta).get_json()["upload_id"]
    put_chunk(client, upload_id, body, 0, 999)
    part = app.extensions["fedmoe_uploads"].root / f"{upload_id}.part"
    with open(part, "ab") as f:  # a chunk being written when the process died: never acknowledged
        f.write(b"half a chunk")
    app.extensions["fedmoe"].close()
    restarted = make_app(gateway_interval=3600).test_client()
    assert restarted.get(f"/api/v1/experts/e/uploads/{upload_id}").get_json()["offset"] == 1000
    assert part.stat().st_size == 1000
    assert put_chunk(restarted, upload_id, body, 1000, len(body) - 1).status_code == 200
    assert complete(restarted, upload_id).status_code == 202  # the digest, rebuilt from the file, matches
    store = restarted.application.extensions["fedmoe"].store
    with store.local_file(store.weights("e").digest) as path:
        weights = load_file(path)
    delta = random_like(ADAPTER, 1)
    assert all(torch.allclose(weights[k], ADAPTER[k] + delta[k]) for k in ADAPTER)  # fedasync: + delta, once


def test_unreadable_upload_records_are_dropped_at_start(make_app, tmp_path):
    uploads = tmp_path / "data" / "uploads"
    uploads.mkdir(parents=True)
    (uploads / ("a" * 32 + ".json")).write_text("{not json")
    (uploads / ("b" * 32 + ".part")).write_bytes(b"orphan")
    (uploads / ("c" * 32 + ".json")).write_text(json.dumps({"upload_id": "c" * 32}))
    app = make_app()
    assert list(uploads.iterdir()) == [] and app.extensions["fedmoe_uploads"].open_count() == 0


def test_abandon_removes_the_upload(app, client):
    upload_id = open_upload(client, body_of()).get_json()["upload_id"]
    assert client.delete(f"/api/v1/experts/e/uploads/{upload_id}").status_code == 204
    assert list(app.extensions["fedmoe_uploads"].root.iterdir()) == []
    assert error(client.delete(f"/api/v1/experts/e/uploads/{upload_id}")) == (404, "not_found")
    assert error(client.get("/api/v1/experts/e/uploads/not-an-id")) == (404, "not_found")


@pytest.fixture
def small_disk(tmp_path) -> Path:
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_a_507_that_records_nothing(make_app, small_disk):
    app = make_app(data_dir=small_disk / "data", gateway_interval=3600)
    client = app.test_client()
    assert put_expert(client, "e", ADAPTER).status_code == 201
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    too_big = open_upload(client, b"x" * 8, size=free + 1)  # cannot fit: refused before anything is written
    assert error(too_big) == (507, "insufficient_storage")
    assert list((small_disk / "data" / "uploads").iterdir()) == []
    body = os.urandom(free // 2)
    upload_id = open_upload(client, body).get_json()["upload_id"]
    filler = small_disk / "filler"
    with open(filler, "wb", buffering=0) as f:  # something else takes the space meanwhile
        try:
            while f.write(b"\0" * (64 << 10)):
                pass
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    r = put_chunk(client, upload_id, body, 0, len(body) - 1)
    assert error(r) == (507, "insufficient_storage")
    assert client.get(f"/api/v1/experts/e/uploads/{upload_id}").get_json()["offset"] == 0
    assert (app.extensions["fedmoe_uploads"].root / f"{upload_id}.part").stat().st_size == 0
    filler.unlink()
    assert put_chunk(client, upload_id, body, 0, len(body) - 1).get_json()["offset"] == len(body)


def test_resumable_pushes_count_in_the_metrics_like_pushes(client):
    body = body_of()
    complete(client, uploaded(client, body))
    text = client.get("/metrics").get_data(as_text=True)
    assert 'fedmoe_updates_total{expert="e",outcome="accepted"} 1.0' in text
    assert f'fedmoe_update_bytes_total{{direction="in",expert="e"}} {float(len(body))}' in text


def test_a_chunk_checked_by_its_prefix_digest_is_refused_when_the_bytes_so_far_differ(app, client):
    """X-FedMoE-Upload-Digest: the digest of the body through the chunk's end, checked against the running digest."""
    body = body_of()
    opened = open_upload(client, body).get_json()
    assert opened["prefix_digests"] is True
    upload_id = opened["upload_id"]
    part = app.extensions["fedmoe"].config.data_dir / "uploads" / f"{upload_id}.part"
    assert put_chunk(client, upload_id, body, 0, 999, **{"X-FedMoE-Upload-Digest": sha(body[:1000])}).status_code == 200
    damaged = body[:1500] + bytes([body[1500] ^ 1]) + body[1501:]
    r = put_chunk(client, upload_id, damaged, 1000, 1999, **{"X-FedMoE-Upload-Digest": sha(body[:2000])})
    assert error(r) == (400, "bad_request") and r.get_json()["error"]["details"]["offset"] == 1000
    assert part.stat().st_size == 1000
    wrong_algorithm = put_chunk(client, upload_id, body, 1000, 1999,
                                **{"X-FedMoE-Upload-Digest": sha(body[:2000], "sha256")})
    assert error(wrong_algorithm) == (400, "bad_request")
    r = put_chunk(client, upload_id, body, 1000, len(body) - 1, **{"X-FedMoE-Upload-Digest": sha(body)})
    assert r.get_json()["offset"] == len(body)
    assert complete(client, upload_id).status_code == 202


# issue 30: bounded uploads that no set of principals can use to lock an honest pusher out ------------------------

def register_relay(app, relay_id: str) -> str:
    r = app.test_client(token=relay_join_token(app.extensions["fedmoe"].config.data_dir)).post(
        "/api/v1/relays", json={"relay_id": relay_id})
    assert r.status_code == 200, r.get_json()
    return r.get_json()["token"]


def test_uploads_belong_to_the_principal_that_opened_them_a_relay_included(app):
    """Issue 30.5: a relay token read another worker's upload by id (200 where another worker got 404)."""
    worker = app.test_client(token=register(app, "w1"))
    relay, other_relay = (app.test_client(token=register_relay(app, r)) for r in ("site-a", "site-b"))
    body = body_of()
    workers = open_upload(worker, body).get_json()["upload_id"]
    for r in (relay.get(f"/api/v1/experts/e/uploads/{workers}"), put_chunk(relay, workers, body, 0, 9),
              complete(relay, workers), relay.delete(f"/api/v1/experts/e/uploads/{workers}")):
        assert error(r) == (404, "not_found")
    relays = open_upload(relay, body_of(2), update_meta(worker_id="w9")).get_json()["upload_id"]
    for r in (worker.get(f"/api/v1/experts/e/uploads/{relays}"), other_relay.get(f"/api/v1/experts/e/uploads/{relays}")):
        assert error(r) == (404, "not_found")
    assert relay.get(f"/api/v1/experts/e/uploads/{relays}").get_json()["offset"] == 0
    assert app.test_client().get(f"/api/v1/experts/e/uploads/{workers}").status_code == 200  # the admin: any
    assert put_chunk(worker, workers, body, 0, len(body) - 1).get_json()["offset"] == len(body)  # untouched


def test_a_relay_holds_a_bounded_number_of_uploads_like_a_worker(app):
    """Issue 30.2: a relay token's uploads had no owner, so the limit of 2 open uploads did not apply to it."""
    relay = app.test_client(token=register_relay(app, "site-a"))
    store, now = app.extensions["fedmoe_uploads"], [1000.0]
    store.clock = lambda: now[0]
    ids = []
    for i in range(5):
        now[0] += 1
        ids.append(open_upload(relay, body_of(i), update_meta(worker_id=f"w{i}")).get_json()["upload_id"])
    assert [relay.get(f"/api/v1/experts/e/uploads/{i}").status_code for i in ids] == [404, 404, 404, 200, 200]
    assert store.open_count() == 2


def test_opens_reserve_no_disk_so_empty_uploads_cannot_refuse_an_honest_one(make_app, tmp_path):
    """Issue 30.2: each open reserved its declared size against free disk though nothing was written; opens that
    never sent a byte claimed the whole disk and every later open got 507. Each open here declares half the disk."""
    st = os.statvfs(tmp_path)
    half = st.f_bavail * st.f_frsize // 2
    app = make_app(gateway_interval=3600, max_body_mb=2 * half / (1 << 20))
    assert put_expert(app.test_client(), "e", ADAPTER).status_code == 201
    for i in range(4):
        attacker = app.test_client(token=register(app, f"attacker-{i}"))
        for k in range(2):
            r = open_upload(attacker, b"", update_meta(), size=half, digest=sha(bytes([i, k])))
            assert r.status_code == 201, r.get_json()
    uploads_dir = app.extensions["fedmoe_uploads"].root
    assert sum(p.stat().st_size for p in uploads_dir.glob("*.part")) == 0
    honest = app.test_client(token=register(app, "honest"))
    body = body_of(7)
    upload_id = open_upload(honest, body).get_json()["upload_id"]
    assert put_chunk(honest, upload_id, body, 0, len(body) - 1).get_json()["offset"] == len(body)
    assert complete(honest, upload_id).status_code == 202


def test_at_the_limit_of_open_uploads_an_open_evicts_the_idlest_never_one_receiving_chunks(make_app):
    app = make_app(gateway_interval=3600, extra={"MAX_OPEN_UPLOADS": 3, "UPLOAD_PROTECTED_SECONDS": 60})
    assert put_expert(app.test_client(), "e", ADAPTER).status_code == 201
    store, now = app.extensions["fedmoe_uploads"], [1000.0]
    store.clock = lambda: now[0]
    workers = {w: app.test_client(token=register(app, w)) for w in ("w1", "w2", "w3", "w4", "w5", "w6")}
    ids = {}
    for w, at in (("w1", 1000), ("w2", 1010), ("w3", 1020)):
        now[0] = at
        ids[w] = open_upload(workers[w], body_of(at)).get_json()["upload_id"]
    now[0] = 1030  # each had a chunk (its open) within the last 60 s
    r = open_upload(workers["w4"], body_of(4))
    assert error(r) == (507, "insufficient_storage") and r.get_json()["error"]["details"]["reason"] == "too_many_uploads"
    assert store.open_count() == 3
    now[0] = 1075
    assert put_chunk(workers["w2"], ids["w2"], body_of(1010), 0, 99).status_code == 200  # w2's is making progress
    now[0] = 1085
    ids["w4"] = open_upload(workers["w4"], body_of(4)).get_json()["upload_id"]  # w1's, idle 85 s, goes
    now[0] = 1090
    ids["w5"] = open_upload(workers["w5"], body_of(5)).get_json()["upload_id"]  # w3's (70 s) goes; not w2's (15 s)
    alive = {w for w, i in ids.items() if workers[w].get(f"/api/v1/experts/e/uploads/{i}").status_code == 200}
    assert alive == {"w2", "w4", "w5"}
    assert error(open_upload(workers["w6"], body_of(6))) == (507, "insufficient_storage")


def test_uploads_expire_after_minutes_and_reopening_does_not_keep_one_alive(make_app, tmp_path):
    default = make_app(data_dir=tmp_path / "defaults")
    assert default.extensions["fedmoe_uploads"].limits.idle_seconds == 300  # --upload-idle-seconds
    app = make_app(gateway_interval=3600, upload_idle_seconds=120)
    assert put_expert(app.test_client(), "e", ADAPTER).status_code == 201
    worker = app.test_client(token=register(app, "w1"))
    store, now = app.extensions["fedmoe_uploads"], [1000.0]
    store.clock = lambda: now[0]
    body, meta = body_of(), update_meta()
    upload_id = open_upload(worker, body, meta).get_json()["upload_id"]
    now[0] = 1100
    assert open_upload(worker, body, meta).get_json()["upload_id"] == upload_id  # the same upload, not renewed
    now[0] = 1121
    assert error(worker.get(f"/api/v1/experts/e/uploads/{upload_id}")) == (404, "not_found")
