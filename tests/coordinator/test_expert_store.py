"""ExpertStore: the adopt-and-record rule, pruning and blob reads, against its backends.

The ``store`` fixture is the place to add a backend (a PostgreSQL manifest, an S3 blob store):
every test here must hold for each.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.storage.blobs import BlobStore
from coordinator.storage.expert_store import ExpertStore, StaleAggregation
from coordinator.storage.manifest import ManifestStore
from protocol.errors import NotFound

SPEC = {"kind": "lora"}
MANIFEST = "[]"


@pytest.fixture
def store(tmp_path):
    s = ExpertStore(BlobStore(tmp_path / "blobs"), ManifestStore(tmp_path / "manifest.sqlite"), keep_versions=2)
    yield s
    s.close()


def temp(store: ExpertStore, data: bytes) -> Path:
    return store.bodies.write_temp(lambda p: p.write_bytes(data))


def stored_digests(store: ExpertStore) -> set[str]:
    return set(store._blobs.digests())


def read(store: ExpertStore, digest: str) -> bytes:
    with store.blobs.open(digest) as f:
        return f.read()


def add_update(store: ExpertStore, name: str, update_id: str, data: bytes):
    body = temp(store, data)
    return store.add_update(name, {"update_id": update_id, "num_samples": 1}, body, store.bodies.digest_of(body),
                            len(data), 4 * len(data), norm=None)


def test_a_recorded_expert_reads_back_through_every_read_path(store):
    store.create_expert("a", SPEC, MANIFEST, temp(store, b"weights v0"))
    ref = store.weights("a")
    assert ref.version == 0 and read(store, ref.digest) == b"weights v0"
    with store.local_file(ref.digest) as path:
        assert path.read_bytes() == b"weights v0"
    local = store.blobs.local_path(ref.digest)
    assert local is None or local.read_bytes() == b"weights v0"  # None: a remote backend
    assert list(store._blobs.tmp_dir.iterdir()) == []  # the temp file was adopted, not copied


def test_a_row_that_cannot_be_committed_leaves_no_blob(store):
    store.create_expert("a", SPEC, MANIFEST, temp(store, b"first"))
    before = stored_digests(store)
    with pytest.raises(Exception):  # "a" exists: the row fails after the blob was adopted
        store.create_expert("a", SPEC, MANIFEST, temp(store, b"second, never recorded"))
    assert stored_digests(store) == before
    assert list(store._blobs.tmp_dir.iterdir()) == []


def test_a_failed_row_keeps_a_blob_another_row_still_names(store):
    store.create_expert("a", SPEC, MANIFEST, temp(store, b"same bytes"))
    with pytest.raises(Exception):  # the backend's own error (sqlite3.IntegrityError here)
        store.create_expert("a", SPEC, MANIFEST, temp(store, b"same bytes"))  # same digest as a's version 0
    assert read(store, store.weights("a").digest) == b"same bytes"


def test_commit_version_drops_applied_payloads_and_prunes_past_keep_versions(store):
    store.create_expert("a", SPEC, MANIFEST, temp(store, b"v0"))
    for version in (1, 2, 3):
        update = add_update(store, "a", f"u{version}", f"delta {version}".encode())
        assert update.blob in stored_digests(store)
        store.commit_version("a", version, temp(store, f"v{version}".encode()), [update], None)
        assert update.blob not in stored_digests(store)  # applied: its payload goes
    kept = {read(store, store.weights("a", v).digest) for v in (2, 3)}
    assert kept == {b"v2", b"v3"} and len(stored_digests(store)) == 2  # keep_versions=2
    with pytest.raises(NotFound, match="pruned"):
        store.weights("a", 1)
    with pytest.raises(NotFound, match="no version 9"):
        store.weights("a", 9)


def test_a_stale_aggregation_stores_nothing(store):
    store.create_expert("a", SPEC, MANIFEST, temp(store, b"v0"))
    update = add_update(store, "a", "u1", b"delta")
    before = stored_digests(store)
    with pytest.raises(StaleAggregation):
        store.commit_version("a", 2, temp(store, b"v2 from a stale step"), [update], None)  # expert is at 0
    assert stored_digests(store) == before and store.rows.pending_count("a") == 1


def test_gateways_past_keep_are_deleted_with_their_blobs(store):
    versions = [store.add_gateway(f"key{i}", temp(store, f"gateway {i}".encode()), {"sources": {}}, keep=2)
                for i in range(4)]
    assert versions == sorted(versions)
    assert store.rows.gateway()["version"] == versions[-1] and store.rows.gateway("key1") is None
    assert {read(store, d) for d in stored_digests(store)} == {b"gateway 2", b"gateway 3"}


def test_orphans_and_unreferenced_blobs_go_but_referenced_ones_stay(store):
    store.create_expert("a", SPEC, MANIFEST, temp(store, b"v0"))
    orphan = store._blobs.put_bytes(b"written just before a crash")
    assert store.remove_orphans() == 1 and orphan not in stored_digests(store)
    store.drop_unreferenced([store.weights("a").digest])  # still named by version 0
    assert read(store, store.weights("a").digest) == b"v0"


def test_quarantined_updates_keep_a_copy_and_lose_their_blob(store):
    store.create_expert("a", SPEC, MANIFEST, temp(store, b"v0"))
    update = add_update(store, "a", "u1", b"bad delta")
    copies = []

    def event(u, kept):
        copies.append(kept)
        from coordinator.access.audit import update_quarantined
        return update_quarantined("a", u.update_id, u.worker_id, "test", kept)

    assert store.quarantine_updates("a", [update], "test", event) == 1
    assert copies == [update.blob] and update.blob not in stored_digests(store)
    assert store.rows.pending_count("a") == 0 and store.rows.update("u1").status == "quarantined"


def test_one_lock_per_expert(store):
    assert store.expert_lock("a") is store.expert_lock("a")
    assert store.expert_lock("a") is not store.expert_lock("b")


def test_a_step_committed_without_sync_keeps_its_payloads_until_the_next_sync(store):
    # A step commits under the expert's lock with durable=False; its caller syncs after letting go of the lock.
    # Until then the rows that let go of the payload may not be on disk, so the payload must still be there.
    store.create_expert("a", SPEC, MANIFEST, temp(store, b"v0"))
    update = add_update(store, "a", "u1", b"delta")
    store.commit_version("a", 1, temp(store, b"v1"), [update], None, durable=False)
    assert update.blob in stored_digests(store)
    assert read(store, store.weights("a").digest) == b"v1"  # the new version is recorded all the same
    store.sync()
    assert update.blob not in stored_digests(store)
    assert {read(store, d) for d in stored_digests(store)} == {b"v0", b"v1"}
