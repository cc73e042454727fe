"""kill -9 of a real coordinator while clients push: nothing acknowledged is lost or applied twice.

A short run of bench/crash.py (the benchmark does >= 50 kills; a restart costs ~1.3 s of imports
alone on an idle machine, so 50 do not fit a unit test's budget). After each restart it checks every
acknowledged update_id, the expert's counters against the applied updates, the weights against
initial + sum of applied deltas, and every blob against its hash.
"""
from bench.crash import run


def test_kill_9_loses_nothing_acknowledged_and_applies_nothing_twice(tmp_path):
    report = run(kills=3, clients=3, seed=1, max_uptime=0.5, data_dir=tmp_path / "data")
    assert report["problems"] == [] and report["server_errors"] == []
    assert len(report["checks"]) == 3 and len(report["restart_s"]["all"]) == 3
    assert report["pushes_acknowledged"] > 0
    # every acknowledged update is applied (fedasync) or was recorded just before a kill and applied at start
    assert report["updates_applied"] >= report["pushes_acknowledged"]
    assert all(c["pending"] == 0 for c in report["checks"])
