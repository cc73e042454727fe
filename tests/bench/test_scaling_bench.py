"""The scaling benchmark: its window arithmetic by hand, and a --quick run end to end (torchrun included)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULE = "bench.scaling"


def record(time: float, tokens: int, sync_seconds: float, steps: int = 1, final: bool = False) -> dict:
    return {"time": time, "tokens": tokens, "sync_seconds": sync_seconds, "steps": steps, "final": final}


def test_window_counts_only_intervals_inside_the_time_every_worker_trained():
    from bench.scaling import window_figures

    early = [record(10, 100, 0.5), record(13, 300, 0.5), record(16, 300, 1.0), record(19, 300, 0.5),
             {"time": 19.5, "final": True, "sync_seconds": 0.1}]
    late = [record(12, 50, 0.2), record(15, 200, 0.4), record(18, 200, 0.2), record(21, 200, 0.2)]
    figures = window_figures([early, late])
    # Common window [12, 19] (latest first sync, earliest last sync). early keeps intervals 13->16 and 16->19
    # (600 tokens over 6 s, syncs at 13 and 16 took 0.5 + 1.0 s); its first (10->13) starts before the window.
    # late keeps 12->15 and 15->18 (400 tokens over 6 s, syncs 0.2 + 0.4 s); 18->21 ends after it.
    assert figures["tokens_per_second"] == pytest.approx(600 / 6 + 400 / 6, abs=0.1)
    assert figures["sync_overhead_pct"] == pytest.approx(100 * (1.5 + 0.6) / (6 + 6), abs=0.01)
    assert figures["common_window_seconds"] == 7 and figures["steps_in_window"] == 4 and figures["syncs"] == 8


def test_quick_run_measures_one_worker_and_one_data_parallel_worker(tmp_path):
    out = tmp_path / "scaling.json"
    proc = subprocess.run([sys.executable, "-m", MODULE, "--quick", "--duration", "8", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    single, parallel = report["records"]
    assert (single["workers"], single["processes"], parallel["workers"], parallel["processes"]) == (1, 1, 1, 2)
    assert single["workers_seen_by_coordinator"] == parallel["workers_seen_by_coordinator"] == 1  # rank 0 only
    assert single["speedup_vs_1_worker"] == 1.0
    assert parallel["speedup_vs_1_worker"] == pytest.approx(parallel["tokens_per_second"] / single["tokens_per_second"],
                                                            rel=1e-2)
    for r in report["records"]:
        assert r["tokens_per_second"] > 0 and 0 < r["sync_overhead_pct"] < 100 and r["syncs"] >= 2
        assert r["name"] in proc.stdout
    assert report["machine"]["cpu_cores"] >= 1 and "2-core" in report["machine"]["note"]
    assert [p.name for p in tmp_path.iterdir()] == ["scaling.json"]
