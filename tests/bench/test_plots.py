"""bench/plots.py: the numbers each plot shows, and that the PNGs are written whole."""
import json
import struct

import pytest

from bench.plots import codec_bytes, loss_series, plot_codec_bytes, plot_expert_losses, read_results


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data.endswith(b"IEND\xaeB`\x82")
    return struct.unpack(">II", data[16:24])


def test_loss_series_is_minutes_since_start_and_skips_syncs_without_loss():
    records = [{"time": 100.0, "train_loss": 4.0}, {"time": 130.0}, {"time": 160.0, "train_loss": 3.0},
               {"time": 190.0, "train_loss": None}]
    assert loss_series(records, start=100.0) == ([0.0, 1.0], [4.0, 3.0])


def test_codec_bytes_pools_suites_and_skips_failed_jobs():
    records = [
        {"label": "int8", "bytes_sent": 1000, "bytes_raw": 4000, "updates": 4},
        {"label": "int8", "bytes_sent": 3000, "bytes_raw": 12000, "updates": 12},
        {"label": "fp16", "bytes_sent": 600, "bytes_raw": 1200, "updates": 3},
        {"label": "broken", "bytes_sent": 0, "bytes_raw": 0, "updates": 0, "error": "diverged"},
    ]
    rows = codec_bytes(records)
    assert [(r.label, r.bytes_per_sync, r.ratio) for r in rows] == [("int8", 250.0, 4.0), ("fp16", 200.0, 2.0)]


def test_plots_are_written_as_png(tmp_path):
    results = tmp_path / "python_expert.results.jsonl"
    results.write_text("".join(json.dumps({"time": 10.0 * i, "train_loss": 5.0 - i}) + "\n" for i in range(4)))
    losses = plot_expert_losses({"python_expert": read_results(results), "sql_expert": []}, tmp_path / "losses.png")
    assert png_size(losses)[0] == pytest.approx(960, abs=2)  # 8 inches at 120 dpi
    records = [{"label": "safetensors", "bytes_sent": 151_000, "bytes_raw": 148_000, "updates": 1},
               {"label": "topk+int4", "bytes_sent": 930, "bytes_raw": 148_000, "updates": 1}]
    codecs = plot_codec_bytes(records, tmp_path / "compression.png")
    assert png_size(codecs)[0] == pytest.approx(1080, abs=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compression.png", "losses.png",
                                                          "python_expert.results.jsonl"]  # no temp files left
