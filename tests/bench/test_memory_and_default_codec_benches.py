"""The arithmetic of bench/worker_memory.py and bench/default_compression.py on made-up rows (no model runs:
the benches themselves take minutes to an hour)."""
from __future__ import annotations

import pytest

from bench.default_compression import sync_bytes
from bench.worker_memory import extrapolate, loss_drift


def row(config: str, loss_path: str, losses: list[float], batch: int = 8, peak: float = 0.0) -> dict:
    return {"model": "m", "config": config, "loss_path": loss_path, "batch_size": batch, "losses": losses,
            "peak_rss_mb": peak}


def test_loss_drift_is_measured_from_before_else_from_the_first_full_logits_row():
    rows = [row("after", "chunked", [2.0, 1.5]), row("before", "logits", [2.0, 1.25]),
            row("logits lean", "logits", [2.5, 1.0])]
    loss_drift(rows)
    assert [r["max_loss_difference"] for r in rows] == [0.25, 0.0, 0.5]
    alone = [row("after", "chunked", [2.0, 1.5]), row("logits lean", "logits", [2.0, 1.0])]  # no 'before' row
    loss_drift(alone)
    assert [r["max_loss_difference"] for r in alone] == [0.5, 0.0]
    no_reference = [row("after", "chunked", [2.0])]
    loss_drift(no_reference)
    assert no_reference[0]["max_loss_difference"] is None


def test_the_batch_8_estimate_is_the_line_through_the_two_smallest_batches():
    rows = [row("before", "logits", [1.0], batch=1, peak=1000.0), row("before", "logits", [1.0], batch=2, peak=1300.0),
            row("after", "chunked", [1.0], batch=1, peak=900.0)]  # one batch size: no line, no estimate
    (estimate,) = extrapolate(rows, "m", 8)
    assert estimate["config"] == "before" and estimate["per_example_mb"] == 300.0
    assert estimate["peak_rss_mb"] == 1000.0 + 7 * 300.0 and estimate["extrapolated_from"] == [1, 2]


def test_sync_bytes_counts_pushes_and_pulls_and_the_diff_pulls_apart():
    records = [{"bytes_sent": 100, "pulled": True, "bytes_down": 400, "pull_codec": None},  # a full pull
               {"bytes_sent": 100, "pulled": True, "bytes_down": 40, "pull_codec": "int8"},
               {"bytes_sent": 200, "pulled": False, "bytes_down": 0, "pull_codec": "int8"}]  # nothing new to pull
    got = sync_bytes(records)
    assert got["push_bytes_mean"] == pytest.approx(400 / 3) and got["pull_bytes_mean"] == 220
    assert got["diff_pull_bytes_mean"] == 40 and got["diff_pulls"] == 1
    assert got["bytes_per_sync"] == pytest.approx((400 + 440) / 3)
