"""bench.adaptive end to end at its smallest (1 worker, 1 round), checked for schema and byte arithmetic."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.adaptive import main
from tests.helpers import run_main

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.bench, pytest.mark.e2e, pytest.mark.slow]


def test_bad_flags_answer_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "bench.adaptive", "--budget", "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == ["error: --budget must be positive, got 0.0"]


def test_smallest_run_compares_auto_with_fixed_codecs_of_the_same_bytes(tmp_path):
    from bench.wanemu import NamespaceUnavailable, check_available

    try:
        check_available()
    except NamespaceUnavailable as exc:
        pytest.skip(f"network namespaces are not available here: {exc}")
    out = tmp_path / "adaptive.json"
    proc = subprocess.run([sys.executable, "-m", "bench.adaptive", "--workers", "1", "--rounds", "1", "--steps", "1",
                           "--rate-mbit", "2", "--budget", "1", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    records = {r["name"]: r for r in report["records"]}
    assert list(records) == ["auto", "randomk+terngrad same bytes", "topk+int8 same bytes", "int4", "int8",
                             "safetensors"]
    for r in records.values():
        assert r["pushes"] == 1 and sum(r["codecs"].values()) == 1 and r["heldout_loss"] > 0
        assert r["link_bytes_up"] > r["bytes_up"] > 0  # the proxy counts every request on the wire, headers too
    same = records["topk+int8 same bytes"]
    assert same["codecs"] == {"topk+int8": 1} and same["config"] == {"ratio": report["same_bytes_ratio"]["topk+int8"]}
    rk = records["randomk+terngrad same bytes"]
    assert rk["codecs"] == {"randomk+terngrad": 1} and rk["config"]["ratio"] == report["same_bytes_ratio"]["randomk+terngrad"]
    summary = report["summary"]["configurations"]
    assert set(summary) == set(records) and summary["auto"]["bytes_vs_auto"] == 1
    for name, v in summary.items():  # one seed: the spread is that seed's value, the paired difference auto's minus it
        assert v["heldout_loss"]["n"] == 1 and v["heldout_loss"]["mean"] == records[name]["heldout_loss"]
        assert records[name]["heldout_loss_without_end"] > 0
        assert v["mean_push_bytes"] == records[name]["mean_push_bytes"] and v["pushes"] == 1
        if name != "auto":
            assert v["auto_minus_this"]["mean"] == pytest.approx(
                records["auto"]["heldout_loss"] - records[name]["heldout_loss"])
    verdict = report["summary"]["verdict"]
    assert verdict["best"] in verdict["rivals"] and "auto" not in verdict["rivals"]
    assert all(summary[n]["mean_push_bytes"] <= 1.5 * summary["auto"]["mean_push_bytes"] for n in verdict["rivals"])
    raw = records["safetensors"]
    assert 4 * raw["numel"] < raw["bytes_up"] < 4 * raw["numel"] + 200 * raw["tensors"]  # fp32 + a header naming each tensor
    assert records["safetensors"]["bytes_up"] > 3.7 * records["int8"]["bytes_up"]  # fp32 vs ~1.06 bytes a parameter
    assert records["int8"]["bytes_up"] > 1.8 * records["int4"]["bytes_up"]  # vs ~0.57
    assert "held-out loss" in proc.stdout and "auto" in proc.stdout

    # --fixed-from: auto again, the fixed codecs' rows taken over unchanged
    again = tmp_path / "again.json"
    proc = subprocess.run([sys.executable, "-m", "bench.adaptive", "--workers", "1", "--rounds", "1", "--steps", "1",
                           "--rate-mbit", "2", "--budget", "1", "--fixed-from", str(out), "--out", str(again)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rerun = json.loads(again.read_text())
    assert [r["name"] for r in rerun["records"]] == list(records)
    assert rerun["records"][1:] == report["records"][1:] and rerun["same_bytes_ratio"] == report["same_bytes_ratio"]


def test_fixed_from_a_run_of_other_settings_is_refused_in_one_line(tmp_path):
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"settings": {"base_model": "tiny-qwen2", "rounds": 9}, "records": [],
                                   "same_bytes_ratio": {}}))
    code, _, stderr = run_main(main, "--fixed-from", str(earlier))  # in this process: the shell's is the test above
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: --fixed-from {earlier} was run with")


@pytest.mark.parametrize("flags, message", [
    (["--extra-only", "--topk-ratios", "0.3"], "error: --extra-only needs --fixed-from (the run whose rows it keeps)"),
    (["--topk-ratios", "2"], "error: --topk-ratios must be within [0.001, 1], got 2.0"),
])
def test_bad_extra_configuration_flags_answer_with_one_line(flags, message):
    code, _, stderr = run_main(main, *flags)  # in this process: ~3 CPU s of imports each as a subprocess
    assert code == 2 and stderr.strip().splitlines() == [message]
