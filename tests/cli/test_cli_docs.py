"""docs/cli.md is generated from the scripts' --help: it must match the code as it is now."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cli_reference_matches_help():
    done = subprocess.run([sys.executable, "scripts/cli_docs.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_every_script_has_a_section_with_its_flags():
    text = (ROOT / "docs" / "cli.md").read_text()
    for script, flag in (("run_coordinator.py", "--gateway-interval"), ("run_worker.py", "--threads"),
                         ("get_gateway_model.py", "--save-gateway"), ("serve.py", "--poll-interval")):
        section = text.split(f"## `{script}`", 1)[1].split("\n## ", 1)[0]
        assert flag in section, (script, flag)
