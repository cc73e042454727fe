"""Issue 30.2, the attack as reported: resumable uploads opened by every identity the workers' join token gives and
never sent a byte, declaring more than the whole free disk; then an honest 9 MiB resumable push, within the minute.

Against a real run_coordinator.py on loopback, over real HTTP (bench/hostile_reservations.py runs the attack and
the honest pushes; ``python -m bench.hostile --only reservation_exhaustion`` reports the same at full size).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from bench.common import SCRATCH_DIR
from bench.hostile_reservations import reservation_exhaustion

pytestmark = pytest.mark.e2e


def test_opens_that_never_send_a_byte_do_not_keep_an_honest_resumable_push_out():
    with tempfile.TemporaryDirectory(prefix="fedmoe-test-", dir=SCRATCH_DIR) as scratch:
        report = reservation_exhaustion(Path(scratch) / "data", identities=45, opens_each=2, honest_pushes=1)
    attack, honest = report["attack"], report["honest"]
    assert report["declared_gib"] > report["free_disk_gib"]  # on main, the opens after the disk's worth were 507s
    assert attack["relay_registration_with_join_token"] == 403  # no relay identity from the workers' join token
    assert attack["statuses"] == {403: 1, 200: 45, 201: 90}, attack["statuses"]  # every open taken, none reserved
    assert attack["status_5xx"] == 0 and attack["disk_bytes"] == 0
    assert honest["outcomes"] == {"resumable": 1}, honest  # in chunks, not the one-request fallback
    assert honest["seconds_from_attack_start_to_first_applied"] < 60
