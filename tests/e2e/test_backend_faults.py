"""Replicas on one real PostgreSQL + one real S3 server when the backends misbehave (issue 30, item 7).

What an outside tester found: a replica started on a mistyped --blobs prefix (or after the object store
restarted empty) deleted its experts from the shared database at start, and every replica then answered
404 for all their acknowledged updates; a bucket that came back empty gave 503 NoSuchBucket until a
restart; a table lock held 15 s held every push (and /health) for as long. The rules these tests hold:
start-up recovery refuses to start rather than destroy shared state, a replica that still holds the blobs
puts them back, a lost bucket is made again while running, and every wait on the database is bounded.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import psycopg
import pytest
import requests

from bench.common import CoordinatorProcess
from bench.shapes import random_tensors
from bench.servers import start_postgres
from protocol.client import CoordinatorClient
from protocol.schemas import API_PREFIX
from tests.e2e import test_replicas as replicas
from tests.e2e.test_replicas import MANIFEST, SPEC, admin, push, register, update_body

backends = replicas.backends  # the module's own PostgreSQL and moto S3 servers (a module-scoped fixture)


class Federation:
    """Replicas (started on demand) sharing a fresh database and a fresh bucket prefix."""

    def __init__(self, url: str, tmp_path: Path) -> None:
        replicas._reset_database(url)
        self.url, self.tmp_path = url, tmp_path
        self.bucket, self.prefix = "fedmoe-faults", uuid.uuid4().hex
        self.servers: list[CoordinatorProcess] = []
        self.acknowledged: list[str] = []

    def replica(self, name: str, prefix: str | None = None) -> CoordinatorProcess:
        server = CoordinatorProcess(
            self.tmp_path / name, "--manifest", self.url, "--blobs", f"s3://{self.bucket}/{prefix or self.prefix}",
            "--admin-token-file", str(self.tmp_path / "admin_token"), "--aggregation", "fedbuff", "--buffer-size",
            "2", "--gateway-interval", "3600", new_session=True)
        self.servers.append(server)
        return server

    def create_and_push(self, server: CoordinatorProcess, pushes: int) -> str:
        """Expert "sql" and ``pushes`` acknowledged updates through ``server`` (one sample each); the worker's token."""
        CoordinatorClient(server.url, token=admin(server)["Authorization"].split()[1]).experts.create(
            "sql", random_tensors(MANIFEST, 7, 0.01), SPEC)
        token = register(server, "w1")
        for n in range(pushes):
            self.push(server, token, n)
        return token

    def push(self, server: CoordinatorProcess, token: str, n: int) -> requests.Response:
        answer = push(server, token, "w1", n, update_body(n), 1)
        assert answer.status_code in (200, 202), answer.text
        self.acknowledged.append(f"w1:{n}")
        return answer

    def check_every_acknowledged_update(self, server: CoordinatorProcess) -> dict:
        """Each acknowledged update answers (applied or pending) and was counted once; the expert's info."""
        for update_id in self.acknowledged:
            r = requests.get(server.url + f"{API_PREFIX}/updates/{update_id}", headers=admin(server), timeout=30)
            assert r.status_code == 200 and r.json()["status"] in ("applied", "pending"), (update_id, r.text)
        info = requests.get(server.url + f"{API_PREFIX}/experts/sql", headers=admin(server), timeout=30).json()
        assert info["updates_applied"] + info["pending_updates"] == len(self.acknowledged), info
        assert info["samples_seen"] == info["updates_applied"]  # one sample each: nothing applied twice
        return info

    def bucket_client(self):
        return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])

    def lose_blobs(self, bucket_too: bool = False) -> int:
        """The object store loses this federation's blobs (and, ``bucket_too``, the whole bucket); how many."""
        s3 = self.bucket_client()
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix).get("Contents", [])]
        for key in keys:
            s3.delete_object(Bucket=self.bucket, Key=key)
        if bucket_too:
            for o in s3.list_objects_v2(Bucket=self.bucket).get("Contents", []):
                s3.delete_object(Bucket=self.bucket, Key=o["Key"])
            s3.delete_bucket(Bucket=self.bucket)
        return len(keys)

    def stored(self) -> set[str]:
        s3 = self.bucket_client()
        try:
            listed = s3.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix).get("Contents", [])
        except s3.exceptions.NoSuchBucket:
            return set()
        return {o["Key"][len(self.prefix) + 1:] for o in listed}

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture
def federation(backends, tmp_path, monkeypatch) -> Iterator[Federation]:
    url, env = backends
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    fed = Federation(url, tmp_path)
    try:
        yield fed
    finally:
        fed.stop()


def refused_start(server: CoordinatorProcess) -> str:
    """Start ``server``, which must refuse: its one error line."""
    with pytest.raises(RuntimeError, match="exited before listening"):
        server.start()
    assert server.proc is not None and server.proc.wait(30) == 2
    errors = [line for line in server.log if line.startswith("error: ")]
    assert len(errors) == 1 and not any("Traceback" in line for line in server.log), "".join(server.log[-30:])
    return errors[0]


def test_a_replica_on_a_mistyped_prefix_refuses_to_start_and_every_update_still_answers(federation):
    a = federation.replica("a")
    a.start()
    federation.create_and_push(a, 5)
    before = federation.check_every_acknowledged_update(a)

    typo = f"{federation.prefix}x"
    error = refused_start(federation.replica("b", prefix=typo))
    assert f"s3://{federation.bucket}/{typo}" in error and "holds none of the 2 blob(s)" in error, error
    assert "version 2 of 'sql'" in error and "pending update 'w1:4'" in error and "--quarantine" in error

    after = federation.check_every_acknowledged_update(a)  # were 404s: the expert was deleted for everyone
    assert (after["version"], after["updates_applied"]) == (before["version"], before["updates_applied"]) == (2, 4)
    assert requests.get(a.url + f"{API_PREFIX}/experts/sql/weights", headers=admin(a), timeout=30).status_code == 200


def test_a_replica_that_holds_the_blobs_puts_them_back_at_start(federation):
    a = federation.replica("a")
    a.start()
    federation.create_and_push(a, 3)  # a made every blob, so its cache holds them all
    weights = requests.get(a.url + f"{API_PREFIX}/experts/sql/weights", headers=admin(a), timeout=30).content
    a.stop()
    assert federation.lose_blobs() >= 2  # the object store lost its data

    b = federation.replica("b")  # a new replica: nothing in its cache
    assert "holds none of the 2 blob(s)" in refused_start(b)
    a.start()  # re-uploads what the manifest needs from its cache, then serves
    assert any("re-uploaded" in line for line in a.log), "".join(a.log[-30:])
    b.start()
    federation.check_every_acknowledged_update(b)
    pulled = requests.get(b.url + f"{API_PREFIX}/experts/sql/weights", headers=admin(b), timeout=30)
    assert pulled.status_code == 200 and pulled.content == weights


def test_a_bucket_lost_while_running_is_made_again_and_pushes_go_on(federation):
    a, b = federation.replica("a"), federation.replica("b")
    a.start()
    token = federation.create_and_push(a, 3)  # version 1, and w1:2 pending
    b.start()
    version_1 = requests.get(a.url + f"{API_PREFIX}/experts/sql/weights", headers=admin(a), timeout=30)
    assert version_1.status_code == 200 and version_1.headers["X-FedMoE-Version"] == "1"
    federation.lose_blobs(bucket_too=True)  # the object store restarted empty

    federation.push(a, token, 3)  # was 503 NoSuchBucket at every push until a restart; makes version 2
    federation.push(b, token, 4)
    # version 1 is still kept (--keep-versions): only a's repair, on a thread of its own once it made the bucket
    # again, puts it back, from a's cache
    deadline = time.monotonic() + 120
    while version_1.headers["ETag"].strip('"') not in federation.stored() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert version_1.headers["ETag"].strip('"') in federation.stored()
    assert any("created it again" in line for line in a.log), "".join(a.log[-30:])
    b.stop()
    b.start()  # every blob the manifest needs is in the store: b starts
    assert federation.check_every_acknowledged_update(b)["version"] == 2
    old = requests.get(b.url + f"{API_PREFIX}/experts/sql/weights?version=1", headers=admin(b), timeout=30)
    assert old.status_code == 200 and old.content == version_1.content


def test_a_table_lock_is_a_503_with_retry_after_within_the_bounded_wait_and_health_answers(tmp_path):
    pg = start_postgres()
    if isinstance(pg, str):
        pytest.skip(f"PostgreSQL cannot start here: {pg}")
    server = CoordinatorProcess(tmp_path / "d", "--manifest", pg.url, new_session=True)
    held, release = threading.Event(), threading.Event()
    answers: dict[str, tuple[int, str | None, bool]] = {}

    def hold_lock() -> None:
        with psycopg.connect(pg.url) as db:  # a transaction: the locks last until it ends
            db.execute("LOCK TABLE experts, updates IN ACCESS EXCLUSIVE MODE")
            held.set()
            release.wait(60)  # the tester held it 15 s; here until every request below is answered
        held.clear()

    def ask(name: str, call) -> None:
        r = call()
        answers[name] = (r.status_code, r.headers.get("Retry-After"), held.is_set())

    try:
        server.start()
        CoordinatorClient(server.url, token=server.headers["Authorization"].split()[1]).experts.create(
            "sql", random_tensors(MANIFEST, 7, 0.01), SPEC)
        token = register(server, "w1")
        assert push(server, token, "w1", 0, update_body(0), 1).status_code == 202
        locker = threading.Thread(target=hold_lock)
        locker.start()
        assert held.wait(30)
        calls = [(f"push {n}", lambda n=n: push(server, token, "w1", n, update_body(n), 1)) for n in (1, 2, 3)]
        calls.append(("health", lambda: requests.get(server.url + f"{API_PREFIX}/health", timeout=60)))
        threads = [threading.Thread(target=ask, args=call) for call in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        release.set()
        locker.join(30)
        for n in (1, 2, 3):  # each answered while the lock was still held: a bounded wait, then 503 + Retry-After
            assert answers[f"push {n}"][0] == 503 and answers[f"push {n}"][1] is not None, answers
            assert answers[f"push {n}"][2], answers
        assert answers["health"][0] == 200 and answers["health"][2], answers
        assert push(server, token, "w1", 4, update_body(4), 1).status_code == 202  # the lock gone: served again
        for n in (1, 2, 3):  # nothing of a refused push was recorded
            r = requests.get(server.url + f"{API_PREFIX}/updates/w1:{n}", headers=server.headers, timeout=30)
            assert r.status_code == 404, r.text
        assert not any("Traceback" in line for line in server.log), "".join(server.log[-60:])
    finally:
        release.set()
        server.stop()
        pg.stop()
