"""The front benchmark at a tiny size: every push is answered with its body's digest, and the figures are there."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import run_main

ROOT = Path(__file__).resolve().parents[2]


def test_small_run_answers_every_push_with_its_digest(tmp_path):
    out = tmp_path / "front.json"
    proc = subprocess.run([sys.executable, "-m", "bench.front", "--connections", "2", "--requests", "3", "--runs", "1",
                           "--size-mb", "2", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["requests"] == 6 and run["wrong_answers"] == []  # spooled (2 MB > 1 MiB) and hashed right, each time
    assert report["body_bytes"] == 2_000_000
    assert run["cpu_ms_per_request"] >= run["loop_cpu_ms_per_request"] >= 0
    assert "loop CPU ms/req" in proc.stdout and [p.name for p in tmp_path.iterdir()] == ["front.json"]


def test_a_bad_flag_is_one_readable_line():
    from bench.front import main

    code, _, stderr = run_main(main, "--server-root", "/nonexistent")  # the command line is the small run's
    assert code == 2 and "no coordinator/http/front.py (or coordinator/front.py) there" in stderr and "Traceback" not in stderr
