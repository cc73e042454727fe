"""The compression benchmark end to end (--quick), checked for schema and byte arithmetic."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULE = "bench.compression"

# tiny-qwen2 (hidden 128, 2 KV heads of 32, MLP 344, 2 layers) with rank-8 LoRA on all 7 projections:
# per layer q 8*128+128*8, k and v 8*128+64*8, o 8*128+128*8, gate and up 8*128+344*8, down 8*344+128*8.
LORA_NUMEL = 2 * (2048 + 1536 + 1536 + 2048 + 3 * 3776)
UPDATES = 2 * 3  # --quick: 2 rounds x 3 workers
# int8 in 256-value blocks with fp16 scales: n + 2 * ceil(n / 256) bytes per tensor; per layer nine
# 1024-value tensors, two of 512 and three of 2752; FMC1 framing is 9 bytes + 4 per tensor (28).
INT8_UPDATE_BYTES = 2 * (9 * (1024 + 8) + 2 * (512 + 4) + 3 * (2752 + 22)) + 9 + 4 * 28
FIELDS = {"suite", "codec", "config", "ratio", "bits_per_param", "eval_loss", "eval_loss_increase_pct",
          "bytes_sent", "bytes_raw", "updates", "losses", "seconds"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("bench") / "compression.json"
    proc = subprocess.run([sys.executable, "-m", MODULE, "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, out


def test_quick_run_writes_one_record_per_configuration(quick_run):
    report, stdout, out = quick_run
    records = {r["codec"]: r for r in report["records"]}
    assert list(records) == ["safetensors", "int8", "topk+int4"]
    for r in report["records"]:
        assert FIELDS <= r.keys(), FIELDS - r.keys()
        assert r["suite"] == "sample" and r["updates"] == UPDATES
        assert set(r["losses"]) == {"python_expert", "sql_expert", "docs_expert"}
        assert r["eval_loss"] == pytest.approx(sum(r["losses"].values()) / 3)
        assert r["bytes_raw"] == UPDATES * 4 * LORA_NUMEL
        assert r["ratio"] == pytest.approx(r["bytes_raw"] / r["bytes_sent"])
        assert r["bits_per_param"] == pytest.approx(32 / r["ratio"])
        assert r["codec"] in stdout
    assert sorted(p.name for p in out.parent.iterdir()) == ["compression.json", "compression.png"]  # no temp files


def test_baseline_is_exactly_zero_and_ratios_match_the_byte_layout(quick_run):
    report, _, _ = quick_run
    records = {r["codec"]: r for r in report["records"]}
    baseline, int8, topk = records["safetensors"], records["int8"], records["topk+int4"]
    assert baseline["eval_loss_increase_pct"] == 0.0
    assert baseline["ratio"] < 1  # safetensors adds a JSON header to the raw fp32 bytes
    assert int8["bytes_sent"] == UPDATES * INT8_UPDATE_BYTES
    assert 3.9 < int8["ratio"] < 4.0
    assert abs(int8["eval_loss_increase_pct"]) < 0.1
    assert topk["ratio"] > 100 and topk["eval_loss_increase_pct"] > int8["eval_loss_increase_pct"]


def test_summary_fields_follow_the_records(quick_run):
    report, _, _ = quick_run
    suite = report["suites"]["sample"]
    assert suite["reference_eval_loss"] == report["records"][0]["eval_loss"]
    assert suite["untrained_eval_loss"] > suite["reference_eval_loss"]  # training helped at all
    within = [r["ratio"] for r in report["records"] if r["eval_loss_increase_pct"] <= 1.0]
    assert report["best_ratio_within_1pct"] == max(within)
    assert report["targets"]["int8: >= 3.9x within 0.1%"]["met"]
    assert math.isfinite(report["seconds"])


def test_codec_seeds_reach_every_random_stage_of_a_pipeline():
    from bench.compression import CodecRun

    run = CodecRun("randomk+terngrad", {"ratio": 0.1, "rescale": True}, error_feedback=False)
    assert run.random_stages() == ["randomk", "terngrad"]
    assert run.seeded_config(3) == {"randomk": {"ratio": 0.1, "rescale": True, "seed": 3}, "terngrad": {"seed": 3}}
    assert run.seeded_config(0) == {"ratio": 0.1, "rescale": True}
    assert CodecRun("int8", {"block_size": 256}).random_stages() == []
    assert CodecRun("int8", {"stochastic": True}).seeded_config(2) == {"stochastic": True, "seed": 2}
    assert CodecRun("topk+int4", {"ratio": 0.01}).seeded_config(5) == {"ratio": 0.01}
