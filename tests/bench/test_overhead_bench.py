"""bench/overhead.py at a tiny size: the report's arithmetic, and syncs that really happened."""
from __future__ import annotations

import json

import pytest
import torch


def test_tiny_run_reports_throughput_per_mode_and_the_overhead(tmp_path, capsys):
    from bench.overhead import main  # in this process: a second interpreter would double the test's time

    out = tmp_path / "overhead.json"
    threads = torch.get_num_threads()
    try:
        assert main(["--phase-seconds", "2", "--sync-interval", "0.8", "--rounds", "1", "--modes", "local",
                     "overlap", "blocking", "--lora-rank", "2", "--batch-size", "2", "--max-seq-len", "64",
                     "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    stdout = capsys.readouterr().out
    report = json.loads(out.read_text())
    modes = report["modes"]
    assert [p["mode"] for p in report["phases"]] == ["local", "overlap", "blocking"]
    for mode, m in modes.items():
        phase = next(p for p in report["phases"] if p["mode"] == mode)
        assert m["tokens_per_s"] == pytest.approx(phase["tokens"] / phase["seconds"])
        assert m["overhead_pct"] == pytest.approx(100 * (1 - m["tokens_per_s"] / modes["local"]["tokens_per_s"]))
        assert m["tokens_per_cpu_s"] == pytest.approx(phase["tokens"] / phase["cpu_seconds"])
        assert 0 < phase["cpu_seconds"] <= 2 * phase["seconds"]  # one torch thread, plus the sync thread
        assert 2 <= phase["seconds"] < 10 and phase["steps"] > 0
    assert report["sync_overhead_pct"] == modes["overlap"]["overhead_pct"]
    assert report["overhead_pct_per_round"] == [pytest.approx(report["sync_overhead_pct"], abs=1e-3)]
    assert report["target"]["met"] == (report["sync_overhead_pct"] <= 2.0)
    assert report["cpu_overhead_pct"] == modes["overlap"]["cpu_overhead_pct"]
    assert modes["local"]["syncs"] == 0 and modes["overlap"]["syncs"] >= 1 and modes["blocking"]["syncs"] >= 1
    # every sync pushed an update, and so did each phase's exit unless no step followed its last sync
    syncs = modes["overlap"]["syncs"] + modes["blocking"]["syncs"]
    assert report["expert"]["updates_applied"] == report["expert"]["version"]
    assert syncs <= report["expert"]["updates_applied"] <= syncs + 2
    # training waits for a whole sync when blocking, only for its edges when overlapping
    blocking = next(p for p in report["phases"] if p["mode"] == "blocking")
    assert blocking["blocked_seconds"] > 0 and modes["overlap"]["blocked_pct"] < modes["blocking"]["blocked_pct"]
    assert "overhead %" in stdout and [p.name for p in tmp_path.iterdir()] == ["overhead.json"]
