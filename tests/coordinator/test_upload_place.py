"""A chunk written by the front straight into its upload's file (coordinator/api/upload_placement.py, UploadStore.place_chunk).

The front's part is played here as it plays it: ask the placer with the request's head, write (some of) the body
into the place and feed its hashers, hand the app the SpooledBody, then release the place.
"""
from __future__ import annotations

import io

import pytest
from werkzeug.test import EnvironBuilder

from coordinator.http.wsgi import SPOOLED_BODY
from coordinator.storage.incoming import BodyPlace, SpooledBody
from coordinator.api.upload_placement import UploadPlacer
from protocol.integrity import content_id, new_hasher
from tests.coordinator.test_uploads import ADAPTER, body_of, error, open_upload, register, sha
from tests.helpers import put_expert, update_meta

PATH = "/api/v1/experts/e/uploads/{}"


@pytest.fixture
def app(make_app):
    app = make_app(gateway_interval=3600)
    assert put_expert(app.test_client(), "e", ADAPTER).status_code == 201
    return app


def head_environ(app, upload_id: str, size: int, start: int, end: int, token: str | None) -> dict:
    """The environ the front builds from a chunk's head, before any of its body is read."""
    headers = {"Content-Range": f"bytes {start}-{end}/{size}", "Content-Length": str(end - start + 1)}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    environ = EnvironBuilder(path=PATH.format(upload_id), method="PUT", headers=headers,
                             input_stream=io.BytesIO()).get_environ()
    environ["CONTENT_LENGTH"] = str(end - start + 1)
    return environ


def admin_token(app) -> str:
    return app.extensions["fedmoe_auth"].admin_token


def fill(place: BodyPlace, data: bytes) -> str:
    """Write ``data`` into the place as the front does; the chunk's own digest (BLAKE3)."""
    own = new_hasher("blake3")
    place.file.write(data)
    for h in (own, *place.hashers):
        h.update(data)
    place.file.flush()
    return content_id("blake3", own.hexdigest())


def test_the_owners_chunk_goes_into_the_upload_file_and_only_there(app):
    owner = register(app, "w1")
    w1 = app.test_client(token=owner)
    body = body_of()
    upload_id = open_upload(w1, body, update_meta()).get_json()["upload_id"]
    placer, size = UploadPlacer(app), len(body)
    assert placer.wants("PUT", PATH.format(upload_id)) and not placer.wants("POST", PATH.format(upload_id))
    assert not placer.wants("PUT", "/api/v1/experts/e/updates")
    # nobody else gets a place: another worker, no token, the join token, an unknown upload, a chunk not at the offset
    join = (app.extensions["fedmoe"].config.data_dir / "join_token").read_text().strip()
    for token, start in ((register(app, "w2"), 0), (None, 0), (join, 0), (owner, 10)):
        assert placer.place(head_environ(app, upload_id, size, start, size - 1, token)) is None
    assert placer.place(head_environ(app, "0" * 32, size, 0, size - 1, owner)) is None

    place = placer.place(head_environ(app, upload_id, size, 0, 999, owner))
    assert place is not None and place.offset == 0
    # while the chunk arrives, the upload is taken: a second chunk (another connection) gets no place
    assert placer.place(head_environ(app, upload_id, size, 0, 999, admin_token(app))) is None
    digest = fill(place, body[:1000])
    spooled = SpooledBody(place.path, 1000, digest, place=place)
    r = w1.put(PATH.format(upload_id), data=body[:1000], environ_overrides={SPOOLED_BODY: spooled},
               headers={"Content-Range": f"bytes 0-999/{size}", "X-FedMoE-Digest": sha(body[:1000])})
    place.release()
    assert r.status_code == 200 and r.get_json()["offset"] == 1000, r.get_json()
    assert place.path.read_bytes() == body[:1000]
    # the rest through a place too, then the push completes: the running digest was fed by the place
    place = placer.place(head_environ(app, upload_id, size, 1000, size - 1, owner))
    assert place is not None and place.offset == 1000
    spooled = SpooledBody(place.path, size - 1000, fill(place, body[1000:]), place=place)
    r = w1.put(PATH.format(upload_id), data=body[1000:], environ_overrides={SPOOLED_BODY: spooled},
               headers={"Content-Range": f"bytes 1000-{size - 1}/{size}", "X-FedMoE-Digest": sha(body[1000:])})
    place.release()
    assert r.get_json()["offset"] == size
    assert w1.post(f"{PATH.format(upload_id)}/complete").status_code == 202


def test_a_placed_chunk_refused_or_cut_short_leaves_nothing_past_the_offset(app):
    client = app.test_client()
    body = body_of()
    size = len(body)
    upload_id = open_upload(client, body).get_json()["upload_id"]
    part = app.extensions["fedmoe"].config.data_dir / "uploads" / f"{upload_id}.part"
    placer, token = UploadPlacer(app), admin_token(app)
    # damaged on the way: 400 with the offset, the bytes are cut off when the front releases the place
    place = placer.place(head_environ(app, upload_id, size, 0, 999, token))
    assert place is not None
    spooled = SpooledBody(place.path, 1000, fill(place, body[:1000]), place=place)
    r = client.put(PATH.format(upload_id), data=body[:1000], environ_overrides={SPOOLED_BODY: spooled},
                   headers={"Content-Range": f"bytes 0-999/{size}", "X-FedMoE-Digest": sha(b"something else")})
    assert error(r) == (400, "bad_request") and r.get_json()["error"]["details"]["offset"] == 0
    place.release()
    assert part.stat().st_size == 0
    # cut short (the client went away): the app never runs; the release cuts the bytes and frees the upload
    place = placer.place(head_environ(app, upload_id, size, 0, 999, token))
    assert place is not None
    fill(place, body[:400])
    place.release()
    assert part.stat().st_size == 0
    assert client.get(PATH.format(upload_id)).get_json()["offset"] == 0
    # the running digest was not touched by either: the whole body still completes
    assert client.put(PATH.format(upload_id), data=body, headers={
        "Content-Range": f"bytes 0-{size - 1}/{size}", "X-FedMoE-Digest": sha(body)}).status_code == 200
    assert client.post(f"{PATH.format(upload_id)}/complete").status_code == 202


def test_a_placed_chunk_with_only_a_prefix_digest_is_hashed_once_and_checked(app):
    client = app.test_client()
    body = body_of()
    size = len(body)
    upload_id = open_upload(client, body).get_json()["upload_id"]
    part = app.extensions["fedmoe"].config.data_dir / "uploads" / f"{upload_id}.part"
    placer, token = UploadPlacer(app), admin_token(app)

    def placed_put(data: bytes, prefix: str):
        environ = head_environ(app, upload_id, size, 0, 999, token)
        environ["HTTP_X_FEDMOE_UPLOAD_DIGEST"] = prefix
        place = placer.place(environ)
        assert place is not None and not place.hash_body  # only the running digest is fed
        fill(place, data)
        spooled = SpooledBody(place.path, len(data), "", place=place)
        r = client.put(PATH.format(upload_id), data=data, environ_overrides={SPOOLED_BODY: spooled},
                       headers={"Content-Range": f"bytes 0-999/{size}", "X-FedMoE-Upload-Digest": prefix})
        place.release()
        return r

    damaged = bytes([body[0] ^ 1]) + body[1:1000]
    r = placed_put(damaged, sha(body[:1000]))
    assert error(r) == (400, "bad_request") and r.get_json()["error"]["details"]["offset"] == 0
    assert part.stat().st_size == 0
    assert placed_put(body[:1000], sha(body[:1000])).get_json()["offset"] == 1000
    assert part.read_bytes() == body[:1000]


def test_a_request_waiting_for_an_upload_a_place_holds_gives_up_with_a_503(app, monkeypatch):
    """A placed chunk keeps the upload's lock until its own request has run on a request thread: requests that wait
    for that lock must not wait for ever, or enough of them would take every request thread (a deadlock)."""
    monkeypatch.setattr("coordinator.storage.upload_files.LOCK_WAIT", 0.2)
    client = app.test_client()
    body = body_of()
    upload_id = open_upload(client, body).get_json()["upload_id"]
    place = UploadPlacer(app).place(head_environ(app, upload_id, len(body), 0, 999, admin_token(app)))
    assert place is not None
    for r in (client.put(PATH.format(upload_id), data=body[:1000], headers={"Content-Range": f"bytes 0-999/{len(body)}"}),
              client.post(f"{PATH.format(upload_id)}/complete")):
        assert error(r) == (503, "unavailable") and r.headers["Retry-After"] == "1", r.get_json()
    place.release()
    r = client.put(PATH.format(upload_id), data=body, headers={"Content-Range": f"bytes 0-{len(body) - 1}/{len(body)}"})
    assert r.get_json()["offset"] == len(body)


def test_a_relay_gets_no_place_in_a_workers_upload_and_a_slow_chunk_never_expires_its_own(app):
    """Issue 30: a relay's token was placed into any upload (as the admin's); an upload receiving a chunk for longer
    than the idle time expired under it (its request then found the upload gone)."""
    from tests.coordinator.test_uploads import register_relay

    body = body_of()
    size = len(body)
    worker = register(app, "w1")
    workers = open_upload(app.test_client(token=worker), body).get_json()["upload_id"]
    relay = register_relay(app, "site-a")
    placer = UploadPlacer(app)
    assert placer.place(head_environ(app, workers, size, 0, 999, relay)) is None
    store, now = app.extensions["fedmoe_uploads"], [1000.0]
    store.clock = lambda: now[0]
    relays = open_upload(app.test_client(token=relay), body, update_meta(worker_id="w9")).get_json()["upload_id"]
    place = placer.place(head_environ(app, relays, size, 0, 999, relay))
    assert place is not None
    now[0] += store.limits.idle_seconds + 60  # the chunk takes longer than the idle time to arrive
    open_upload(app.test_client(token=worker), body_of(2))  # an open sweeps idle uploads: not this one
    spooled = SpooledBody(place.path, 1000, fill(place, body[:1000]), place=place)
    r = app.test_client(token=relay).put(PATH.format(relays), data=body[:1000], environ_overrides={SPOOLED_BODY: spooled},
                                         headers={"Content-Range": f"bytes 0-999/{size}", "X-FedMoE-Digest": sha(body[:1000])})
    place.release()
    assert r.status_code == 200 and r.get_json()["offset"] == 1000, r.get_json()
    now[0] += store.limits.idle_seconds - 1  # idle time counts from the chunk
    assert app.test_client(token=relay).get(PATH.format(relays)).get_json()["offset"] == 1000
