"""The resumable-push benchmark end to end (a small fast run), checked for schema and arithmetic."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"mode", "broken", "body_mib", "wire_mib", "resent_mib", "seconds", "break_cost_s", "chunks", "resumes"}


def test_a_break_at_90_percent_costs_a_one_shot_push_the_body_and_a_resumable_one_a_chunk(tmp_path):
    out = tmp_path / "resume.json"
    proc = subprocess.run([sys.executable, "-m", "bench.resume", "--size-mb", "8", "--rate-mbit", "400",
                           "--rtt-ms", "0", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(r["mode"], r["broken"]): r for r in report["rows"]}
    assert set(rows) == {("one-shot", False), ("one-shot", True), ("resumable", False), ("resumable", True)}
    assert all(FIELDS <= r.keys() for r in rows.values())
    body = rows["one-shot", False]["body_mib"]
    assert rows["one-shot", False]["resent_mib"] == rows["resumable", False]["resent_mib"] == 0
    assert rows["one-shot", True]["resent_mib"] >= 0.85 * body  # the whole body again, less the 10% never sent
    assert rows["resumable", True]["resent_mib"] <= body / 8 + 0.05  # at most one chunk (1/8 of the body)
    assert rows["resumable", False]["chunks"] == 8 and rows["resumable", True]["resumes"] == 1
    assert "re-sent MiB" in proc.stdout
