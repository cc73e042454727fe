"""The learning benchmark (--quick, tiny-qwen2): every option trains from the same start, and the exact ones agree."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULE = "bench.learning"


def test_quick_run_compares_every_option_with_fp32(tmp_path):
    out = tmp_path / "learning.json"
    proc = subprocess.run([sys.executable, "-m", MODULE, "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["base_model"] == "tiny-qwen2" and report["settings"]["steps"] == 2
    records = {r["option"]: r for r in report["records"]}
    assert list(records) == ["fp32", "bf16 autocast", "grad-accum 2", "gradient checkpointing"]
    fp32 = records["fp32"]
    assert len({r["heldout_before"] for r in records.values()}) == 1  # the same start for every option
    assert fp32["heldout_after"] < fp32["heldout_before"]  # two steps at lr 1e-2 already help
    for exact in ("grad-accum 2", "gradient checkpointing"):  # the same step up to rounding
        assert records[exact]["heldout_after"] == pytest.approx(fp32["heldout_after"], abs=1e-3)
    assert records["bf16 autocast"]["heldout_after"] == pytest.approx(fp32["heldout_after"], abs=0.05)
    for r in records.values():
        assert r["after_minus_fp32"] == pytest.approx(r["heldout_after"] - fp32["heldout_after"], abs=1e-4)
        assert r["option"] in proc.stdout
    assert fp32["speed_vs_fp32"] == 1.0
    assert [p.name for p in tmp_path.iterdir()] == ["learning.json"]
