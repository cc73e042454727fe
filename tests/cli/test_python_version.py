"""The Python the project runs on: the servers refuse an older one in one line, the README says the same minimum,
and this suite fails when it runs on an interpreter older than that (CI included)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from protocol.python_version import MINIMUM, require_supported_python

ROOT = Path(__file__).resolve().parents[2]


def test_this_interpreter_is_one_the_project_supports():
    assert sys.version_info[:2] >= MINIMUM  # CI on an older Python fails here, not on a first connection


def test_the_readme_states_the_minimum_the_code_checks():
    stated = re.findall(r"Python (\d+)\.(\d+)\+", (ROOT / "README.md").read_text())
    assert stated and {tuple(map(int, v)) for v in stated} == {MINIMUM}


@pytest.mark.parametrize("main", ["run_coordinator", "serve"])
def test_an_older_python_is_refused_at_start_in_one_line(main, monkeypatch, capsys):
    """Was (3.10): "listening on ...", then AttributeError: module 'asyncio' has no attribute 'timeout' per
    connection."""
    import importlib

    module = importlib.import_module(main)
    monkeypatch.setattr(module, "require_supported_python",
                        lambda: require_supported_python((3, 10, 12)))  # what main() calls first
    with pytest.raises(SystemExit) as done:
        module.main(["--port", "0"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(lines) == 1
    assert lines[0] == ("error: FedMoE needs Python 3.11 or newer (the HTTP front uses asyncio.timeout); "
                        "this is Python 3.10.12")
