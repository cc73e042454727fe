"""Group commit: writers waiting at once share one flush, none returns before a flush that began after it."""
import os
import threading

import pytest

from coordinator.access import audit
from coordinator.storage.group_commit import GroupCommit
from coordinator.storage.manifest import CHECKPOINT_WAL_BYTES, ManifestStore


class GatedFlush:
    """A flush that records its start and end, and blocks until released while ``gate`` is set."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        n = self.calls
        self.log.append(f"start {n}")
        if n == 1:
            self.started.set()
            assert self.release.wait(10)
        self.log.append(f"end {n}")


def test_writers_arriving_during_a_flush_share_the_next_one():
    flush = GatedFlush()
    group = GroupCommit(flush)
    first = threading.Thread(target=lambda: (group.sync(), flush.log.append("first returned")))
    first.start()
    assert flush.started.wait(10)  # the first writer leads flush 1, which is held open
    followers = [threading.Thread(target=lambda i=i: (group.sync(), flush.log.append(f"follower {i} returned")))
                 for i in range(3)]
    for t in followers:
        t.start()
    while group.syncs < 4:  # all three registered while flush 1 runs
        threading.Event().wait(0.001)
    flush.release.set()
    for t in [first, *followers]:
        t.join(10)
    assert (group.syncs, group.flushes, flush.calls) == (4, 2, 2)  # 4 writers, 2 flushes
    # flush 1 began before the followers committed: none of them may return until flush 2 has ended
    for i in range(3):
        assert flush.log.index(f"follower {i} returned") > flush.log.index("end 2")
    assert flush.log.index("first returned") > flush.log.index("end 1")


def test_a_failed_flush_raises_to_its_writer_and_the_next_writer_flushes_again():
    calls = []

    def flush() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(5, "I/O error")

    group = GroupCommit(flush)
    with pytest.raises(OSError):
        group.sync()
    group.sync()
    assert (len(calls), group.flushes) == (2, 1)


def test_flush_checkpoints_and_truncates_a_large_wal(tmp_path):
    rows = ManifestStore(tmp_path / "m.sqlite", group_commit=True)
    wal = tmp_path / "m.sqlite-wal"
    event = audit.Event("update_rejected", "x" * 20_000)
    while wal.stat().st_size <= CHECKPOINT_WAL_BYTES:
        rows.add_event(event)
    rows.flush()
    assert wal.stat().st_size == 0  # checkpointed into the database, then truncated
    assert len(rows.events(1000)) > 40  # nothing was lost on the way
    rows.close()
    reopened = ManifestStore(tmp_path / "m.sqlite")
    assert len(reopened.events(1000)) > 40
    reopened.close()


def test_without_group_commit_each_commit_is_synced_by_sqlite(tmp_path):
    rows = ManifestStore(tmp_path / "m.sqlite")
    assert rows._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    rows.flush()  # a no-op, as for PostgreSQL
    grouped = ManifestStore(tmp_path / "g.sqlite", group_commit=True)
    assert grouped._db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL: flush() syncs
    assert grouped._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    assert os.path.exists(tmp_path / "g.sqlite-wal")
    rows.close()
    grouped.close()
