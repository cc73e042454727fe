"""Start-up recovery never destroys recorded state on the strength of one process's view (issue 30, item 7).

On SQLite + local files: a data dir whose blobs are missing (an unmounted blobs/, files copied without
them) stops the coordinator with one line and changes nothing; a fresh manifest next to old blobs deletes
none of them; only the operator's ``--quarantine`` sets an expert aside, and its acknowledged updates then
still answer. The same rules on PostgreSQL + S3: tests/e2e/test_backend_faults.py.
"""
from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.storage.blobs import BlobStore
from coordinator.config import CoordinatorConfig
from coordinator.storage.expert_store import ExpertStore
from coordinator.quarantine import quarantine_command
from coordinator.recovery import RecoveryRefused, StoreMismatch, recover
from coordinator.storage.manifest import ManifestStore
from tests import launcher
from tests.helpers import make_adapter, push, put_expert, random_like, update_meta

ROOT = Path(__file__).resolve().parents[2]


def blob_files(data_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (data_dir / "blobs").rglob("*") if p.is_file() and p.parent.name != "tmp"}


@pytest.fixture
def federation(make_app, tmp_path):
    """Expert "e" at version 0 with one acknowledged pending update (fedbuff K=2), and expert "f"; closed."""
    app = make_app(aggregation="fedbuff", buffer_size=2)
    client = app.test_client()
    adapter = make_adapter()
    assert put_expert(client, "e", adapter).status_code == 201
    assert put_expert(client, "f", make_adapter(seed=1)).status_code == 201
    meta = update_meta()
    assert push(client, "e", random_like(adapter, 1), meta).status_code == 202
    c = app.extensions["fedmoe"]
    paths = {"e": c.store.blobs.local_path(c.store.weights("e").digest), "update": c.store.blobs.local_path(c.store.rows.update(
        meta["update_id"]).blob)}
    c.close()
    return {"data": tmp_path / "data", "update_id": meta["update_id"], "paths": paths}


def test_a_data_dir_whose_blobs_are_gone_refuses_to_start_and_changes_nothing(make_app, federation):
    data = federation["data"]
    saved = data.parent / "saved-blobs"
    shutil.move(data / "blobs", saved)  # as if blobs/ were a mount that did not come up
    (data / "blobs").mkdir()

    with pytest.raises(StoreMismatch) as refused:
        make_app(aggregation="fedbuff", buffer_size=2)
    message = str(refused.value)
    assert "holds none of the 3 blob(s)" in message and str(data / "blobs") in message
    assert "version 0 of 'e'" in message and f"pending update {federation['update_id']!r}" in message
    assert "--quarantine" in message and "\n" not in message

    shutil.rmtree(data / "blobs")
    shutil.move(saved, data / "blobs")  # the mount is back: everything is as it was
    client = make_app(aggregation="fedbuff", buffer_size=2).test_client()
    assert [e["name"] for e in client.get("/api/v1/experts").get_json()["experts"]] == ["e", "f"]
    status = client.get(f"/api/v1/updates/{federation['update_id']}").get_json()
    assert status["status"] == "pending"  # was "quarantined" (and expert e deleted) before


def test_one_lost_blob_is_named_and_nothing_is_set_aside(make_app, federation):
    federation["paths"]["update"].unlink()
    with pytest.raises(StoreMismatch, match=r"is missing 1 of the 3 blob\(s\).*pending update"):
        make_app(aggregation="fedbuff", buffer_size=2)


def test_a_fresh_manifest_next_to_old_blobs_deletes_none_of_them(make_app, federation):
    data = federation["data"]
    before = blob_files(data)
    for name in ("manifest.sqlite", "manifest.sqlite-wal", "manifest.sqlite-shm"):
        (data / name).unlink(missing_ok=True)  # e.g. a manifest restored from nothing, or another one

    client = make_app().test_client()
    assert client.get("/api/v1/experts").get_json()["experts"] == []
    assert before.items() <= blob_files(data).items()  # were all deleted as "unrecorded" at start


def test_the_admin_command_sets_aside_an_expert_whose_blob_is_lost(make_app, federation):
    data = federation["data"]
    federation["paths"]["e"].unlink()
    config = CoordinatorConfig(data_dir=data, aggregation="fedbuff", buffer_size=2)
    with pytest.raises(ValueError, match="'f': its weights and pending updates are all there"):
        quarantine_command(config, ["e", "f"])  # f is healthy: nothing at all is changed
    with pytest.raises(ValueError, match="no expert of that name"):
        quarantine_command(config, ["nope"])

    assert quarantine_command(config, ["e"]) == [f"expert 'e' set aside (its blob is missing (set aside by "
                                                 f"run_coordinator.py --quarantine)); 1 blob(s) kept in "
                                                 f"{data / 'quarantine'}"]
    client = make_app(aggregation="fedbuff", buffer_size=2).test_client()  # starts again
    assert [e["name"] for e in client.get("/api/v1/experts").get_json()["experts"]] == ["f"]
    status = client.get(f"/api/v1/updates/{federation['update_id']}")
    assert status.status_code == 200, status.data  # was a 404: the expert's acknowledged updates vanished
    assert (status.get_json()["status"], status.get_json()["expert_version"]) == ("quarantined", None)
    events = client.get("/api/v1/events?kind=expert_quarantined").get_json()["events"]
    assert [e["expert"] for e in events] == ["e"] and "--quarantine" in events[0]["message"]


def test_the_admin_command_on_the_command_line(federation):
    federation["paths"]["update"].unlink()
    run = [sys.executable, str(ROOT / "run_coordinator.py"), "--data-dir", str(federation["data"]),
           "--aggregation", "fedbuff", "--buffer-size", "2", "--quarantine"]
    healthy = launcher.run(run + ["f"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert healthy.returncode == 2 and healthy.stderr.count("\n") == 1 and "nothing was changed" in healthy.stderr
    done = launcher.run(run + ["e"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"1 pending update(s) of 'e' set aside: {federation['update_id']}\n"


def test_a_database_that_is_down_at_start_is_one_line(tmp_path):
    """Was a traceback of BackendUnavailable: a replica started before its PostgreSQL answers."""
    run = launcher.run([sys.executable, str(ROOT / "run_coordinator.py"), "--data-dir", str(tmp_path / "d"),
                        "--port", "0", "--manifest", "postgresql://postgres@127.0.0.1:1/fedmoe"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "PostgreSQL" in errors[0] and "not answering" in errors[0], run.stderr


class ThreadLocks:
    """ExpertStore's cross-replica locks, as a shared (PostgreSQL) manifest brings them; here per thread only."""

    @contextlib.contextmanager
    def hold(self, name: str) -> Iterator[None]:
        yield


def test_unusable_data_in_a_shared_manifest_is_named_and_not_set_aside(federation):
    """On PostgreSQL a replica may not quarantine alone: the same check on SQLite with the store marked shared."""
    federation["paths"]["update"].write_bytes(b"\0" * 64)  # there, but not a payload the loader can read
    data = federation["data"]
    store = ExpertStore(BlobStore(data / "blobs"), ManifestStore(data / "manifest.sqlite"), keep_versions=20,
                        locks=ThreadLocks())
    try:
        with pytest.raises(RecoveryRefused) as refused:
            recover(store, aggregate=lambda name: None)
        assert f"pending update {federation['update_id']!r} of 'e'" in str(refused.value)
        assert "--quarantine e" in str(refused.value)
        assert store.rows.update(federation["update_id"]).status == "pending"  # nothing changed
        assert not (data / "quarantine").exists()
    finally:
        store.close()
