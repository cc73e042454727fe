"""The poisoning benchmark end to end (--quick), checked for schema and arithmetic."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_main

ROOT = Path(__file__).resolve().parents[2]
MODULE = "bench.byzantine"
FIELDS = {"attack", "robust", "norm_check", "label", "workers", "eval_loss", "version", "pushed", "rejected",
          "seconds", "loss_vs_honest_pct", "within_target"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("bench") / "byzantine.json"
    proc = subprocess.run([sys.executable, "-m", MODULE, "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, out


def test_quick_run_writes_one_record_per_job(quick_run):
    report, stdout, out = quick_run
    records = report["records"]
    assert [(r["attack"], r["robust"]) for r in records] == [(None, "none"), ("scale", "none"), ("scale", "median")]
    rounds = report["settings"]["rounds"]
    for r in records:
        assert FIELDS <= r.keys(), FIELDS - r.keys()
        assert r["workers"] == (4 if r["attack"] is None else 5)
        assert r["pushed"] == rounds * r["workers"] and r["rejected"] == 0
        assert r["version"] == rounds  # fedbuff with one step per round of pushes
        assert r["loss_vs_honest_pct"] == pytest.approx(
            100 * (r["eval_loss"] - report["honest_eval_loss"]) / report["honest_eval_loss"], abs=1e-3)
        assert r["within_target"] == (r["loss_vs_honest_pct"] <= report["target_pct"])
    assert records[0]["loss_vs_honest_pct"] == 0.0
    assert report["untrained_eval_loss"] > report["honest_eval_loss"]  # training helped at all
    assert "honest-only" in stdout and "median" in stdout
    assert [p.name for p in out.parent.iterdir()] == ["byzantine.json"]  # no temp file left behind


def test_bad_flag_is_one_line(tmp_path):
    from bench.byzantine import main

    # main() in this process (the module's command line is the quick run's): a subprocess is ~6 CPU s of imports
    code, _, stderr = run_main(main, "--rounds", "0", "--out", str(tmp_path / "x.json"))
    assert code == 2 and stderr.strip() == "error: --rounds must be at least 1, got 0"
    assert not (tmp_path / "x.json").exists()
