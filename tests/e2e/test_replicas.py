"""Two coordinator processes on one real PostgreSQL + one real S3-compatible server serve one federation."""
from __future__ import annotations

import json
import os
import random
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch

from bench.common import CoordinatorProcess
from bench.shapes import PROJECTIONS, lora_manifest, random_tensors
from compression import make_codec
from compression.wire import encode_update
from protocol.client import CoordinatorClient
from protocol.integrity import DIGEST_HEADER, digest_header
from protocol.schemas import API_PREFIX, REDIRECT_HEADER, UPDATE_HEADER
from protocol.tensors import loads
from bench.servers import s3_env, start_postgres, start_s3

MANIFEST = lora_manifest("tiny-qwen2", 4)
SPEC = {"lora": {"rank": 4, "alpha": 8.0, "target_modules": list(PROJECTIONS)},
        "base_model": {"id": "tiny-qwen2", "fingerprint": "ab" * 32}}


@pytest.fixture(scope="module")
def backends() -> Iterator[tuple[str, dict[str, str]]]:
    pg = start_postgres()
    if isinstance(pg, str):
        pytest.skip(f"PostgreSQL cannot start here: {pg}")
    s3 = start_s3()
    if isinstance(s3, str):
        pg.stop()
        pytest.skip(f"S3-compatible server cannot start here: {s3}")
    try:
        yield pg.url, s3_env(s3)
    finally:
        s3.stop()
        pg.stop()


@pytest.fixture
def replicas(backends, tmp_path, monkeypatch) -> Iterator[list[CoordinatorProcess]]:
    """Two replicas sharing a fresh database schema-less namespace (a new bucket prefix, fresh tables)."""
    url, env = backends
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _reset_database(url)
    token_file = tmp_path / "admin_token"
    flags = ("--manifest", url, "--blobs", f"s3://fedmoe-test/{uuid.uuid4().hex}", "--admin-token-file",
             str(token_file), "--aggregation", "fedbuff", "--buffer-size", "2", "--redirect-pulls-mb", "0.01",
             "--gateway-interval", "3600")
    servers = [CoordinatorProcess(tmp_path / f"replica{i}", *flags, new_session=True) for i in range(2)]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()


def _reset_database(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as db:
        db.execute("DROP SCHEMA public CASCADE")
        db.execute("CREATE SCHEMA public")


def admin(server: CoordinatorProcess) -> dict[str, str]:
    if "--admin-token-file" not in server.flags:
        return server.headers
    token_file = Path(server.flags[server.flags.index("--admin-token-file") + 1])
    return {"Authorization": f"Bearer {token_file.read_text().strip()}"}


def register(server: CoordinatorProcess, worker: str) -> str:
    r = requests.post(server.url + f"{API_PREFIX}/workers", headers=admin(server), timeout=30,
                      json={"worker_id": worker, "specialty": "sql", "base_model": SPEC["base_model"]})
    assert r.status_code == 200, r.text
    return r.json()["token"]


def push(server: CoordinatorProcess, token: str, worker: str, n: int, body: bytes, samples: int) -> requests.Response:
    meta = {"update_id": f"{worker}:{n}", "base_version": 0, "num_samples": samples, "codec": "int8",
            "codec_config": {}, "worker_id": worker}
    return requests.post(server.url + f"{API_PREFIX}/experts/sql/updates", data=body, timeout=60, headers={
        "Authorization": f"Bearer {token}", UPDATE_HEADER: json.dumps(meta), DIGEST_HEADER: digest_header(body),
        "Content-Type": "application/octet-stream"})


def update_body(seed: int) -> bytes:
    return encode_update(random_tensors(MANIFEST, seed, 1e-3), MANIFEST, make_codec("int8", {}), seed=1)


def test_two_replicas_serve_one_federation(replicas):
    a, b = replicas
    CoordinatorClient(a.url, token=admin(a)["Authorization"].split()[1]).experts.create(
        "sql", random_tensors(MANIFEST, 7, 0.01), SPEC)
    token = register(a, "w1")  # issued by replica a, good at replica b (tokens live in PostgreSQL)
    bodies = [update_body(i) for i in range(4)]
    answers = [push((a, b)[i % 2], token, "w1", i, body, 10 + i).status_code for i, body in enumerate(bodies)]
    assert answers == [202, 202, 202, 202]
    # the same update again, at the other replica: recognised, applied once
    again = push(a, token, "w1", 1, bodies[1], 11)
    assert again.status_code == 200 and again.json()["status"] == "applied"
    conflict = push(b, token, "w1", 1, bodies[2], 11)  # same id, other bytes
    assert conflict.status_code == 409
    infos = [requests.get(s.url + f"{API_PREFIX}/experts/sql", headers=admin(s), timeout=30).json() for s in (a, b)]
    for info in infos:
        assert (info["version"], info["updates_applied"], info["pending_updates"]) == (2, 4, 0)
        assert info["samples_seen"] == 10 + 11 + 12 + 13

    # weights: the same bytes from both; a client that follows redirects gets them from the object store
    plain = [requests.get(s.url + f"{API_PREFIX}/experts/sql/weights", headers=admin(s), timeout=30) for s in (a, b)]
    assert plain[0].status_code == plain[1].status_code == 200 and plain[0].content == plain[1].content
    redirect = requests.get(b.url + f"{API_PREFIX}/experts/sql/weights", headers=admin(b) | {REDIRECT_HEADER: "1"},
                            allow_redirects=False, timeout=30)
    assert redirect.status_code == 307 and redirect.headers["Location"].startswith(os.environ["AWS_ENDPOINT_URL"])
    assert redirect.headers["ETag"] == plain[0].headers["ETag"]
    pulled = CoordinatorClient(b.url, token=admin(b)["Authorization"].split()[1]).experts.pull("sql")
    assert pulled.version == 2 and pulled.etag == plain[0].headers["ETag"]
    expected = loads(plain[0].content)
    assert all(torch.equal(pulled.tensors[k], expected[k]) for k in expected)


def test_kill_9_of_a_replica_loses_nothing_acknowledged(replicas):
    a, b = replicas
    CoordinatorClient(a.url, token=admin(a)["Authorization"].split()[1]).experts.create(
        "sql", random_tensors(MANIFEST, 7, 0.01), SPEC)
    token = register(a, "w1")
    bodies = [update_body(i) for i in range(3)]
    acknowledged: list[str] = []
    stop = threading.Event()

    def pusher(server: CoordinatorProcess, worker_offset: int) -> None:
        n = worker_offset
        while not stop.is_set() and n < worker_offset + 40:
            try:
                r = push(server, token, "w1", n, bodies[n % 3], 1)
            except requests.RequestException:
                n += 1
                continue
            if r.status_code in (200, 202):
                acknowledged.append(f"w1:{n}")
            n += 1

    threads = [threading.Thread(target=pusher, args=(s, i * 1000)) for i, s in enumerate((a, b))]
    for t in threads:
        t.start()
    while len(acknowledged) < 6:  # some pushes through both replicas, then a crash mid-stream
        threading.Event().wait(0.05)
    random.choice([a, b]).kill()
    stop.set()
    for t in threads:
        t.join()
    survivor = a if a.proc.poll() is None else b
    for update_id in acknowledged:
        r = requests.get(survivor.url + f"{API_PREFIX}/updates/{update_id}", headers=admin(survivor), timeout=30)
        assert r.status_code == 200, f"{update_id} acknowledged, then lost: {r.text}"
    info = requests.get(survivor.url + f"{API_PREFIX}/experts/sql", headers=admin(survivor), timeout=30).json()
    assert info["updates_applied"] + info["pending_updates"] >= len(acknowledged)
    assert info["samples_seen"] == info["updates_applied"]  # one sample each: nothing applied twice


def test_a_database_that_goes_down_is_a_503_with_retry_after_and_one_log_line(tmp_path):
    pg = start_postgres()
    if isinstance(pg, str):
        pytest.skip(f"PostgreSQL cannot start here: {pg}")
    server = CoordinatorProcess(tmp_path / "d", "--manifest", pg.url, "--aggregation", "fedbuff", "--buffer-size",
                                "2", new_session=True)
    try:
        server.start()
        headers = server.headers
        CoordinatorClient(server.url, token=headers["Authorization"].split()[1]).experts.create(
            "sql", random_tensors(MANIFEST, 7, 0.01), SPEC)
        token = register(server, "w1")
        assert push(server, token, "w1", 0, update_body(0), 1).status_code == 202
        pg.stop()
        down = push(server, token, "w1", 1, update_body(1), 1)
        assert down.status_code == 503, down.text
        assert down.headers["Retry-After"].isdigit()
        assert down.json()["error"]["details"]["backend"] == "postgresql"
        assert len(server.lines(lambda line: "PostgreSQL" in line and "ERROR" in line)) == 1  # one line, naming it
        assert not any("Traceback" in line for line in server.log), "".join(server.log[-60:])
    finally:
        server.stop()
        pg.stop()
