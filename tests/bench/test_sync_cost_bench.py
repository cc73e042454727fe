"""bench/sync_cost.py at a tiny size: every phase of every sync is charged, both writers run."""
from __future__ import annotations

import json

import torch

from bench.sync_cost import PHASES


def test_tiny_run_charges_every_phase_of_every_sync_to_both_writers(tmp_path, capsys):
    from bench.sync_cost import main  # in this process: a second interpreter would double the test's time

    out = tmp_path / "sync_cost.json"
    threads = torch.get_num_threads()
    try:
        assert main(["--base-model", "tiny-qwen2", "--lora-rank", "2", "--syncs", "2", "--blocks", "1",
                     "--state-parent", str(tmp_path), "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    assert set(report["per_sync"]) == {"legacy", "current"}
    for name, rows in report["per_sync"].items():
        assert len(rows) == 2 and report["variants"][name]["syncs"] == 2
        for row in rows:
            assert all(row[phase] > 0 for phase in PHASES), (name, row)  # each step of the sync ran
            assert sum(row[phase] for phase in PHASES) <= row["total"] + 1e-3  # one thread's share of the process
            assert row["bytes_down"] > 0  # the expert changed at every push: a full pull each time
    legacy, current = report["variants"]["legacy"], report["variants"]["current"]
    assert report["ratios"]["checkpoint"] == round(legacy["checkpoint"] / current["checkpoint"], 2)
    assert "legacy / current" in capsys.readouterr().out
    assert not list(tmp_path.glob("fedmoe-sync-cost-*"))  # state dirs and coordinator data removed
