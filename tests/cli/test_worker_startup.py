"""run_worker.py answers --help and flag mistakes before importing torch (seconds of imports).

Checked by what is imported, not by a clock: a subprocess runs main() and lists the heavy modules
that got loaded.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT, env

HEAVY = ("torch", "transformers", "peft", "worker.runner", "worker.federation")
PROBE = """
import json, sys
import run_worker
try:
    code = run_worker.main(json.loads(sys.argv[1]))
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def probe(*args: str) -> tuple[dict, str]:
    result = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(args))], cwd=ROOT, env=env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


@pytest.mark.parametrize("args, code, message", [
    (["--help"], 0, None),
    (["--version"], 0, None),
    ([], 2, "the following arguments are required: --specialty"),
    (["--specialty", "sql_expert", "--bogus"], 2, "unrecognized arguments: --bogus"),
    (["--specialty", "sql_expert", "--speed-factor", "fast"], 2, "invalid float value: 'fast'"),
    (["--specialty", "sql_expert", "--dataset", "nowhere.jsonl"], 2, "--dataset 'nowhere.jsonl' does not exist"),
    (["--specialty", "sql_expert", "--coordinator-url", "localhost:5000"], 2, "not an http(s) address"),
    (["--specialty", "sql_expert", "--ca-cert", "nowhere.pem"], 2, "--ca-cert 'nowhere.pem' does not exist"),
])
def test_help_and_flag_errors_import_no_heavy_module(args, code, message):
    outcome, stderr = probe(*args)
    assert outcome == {"code": code, "heavy": []}
    if message is not None:
        assert message in stderr and "Traceback" not in stderr


@pytest.mark.slow  # imports torch and transformers in a fresh interpreter
def test_a_valid_command_line_does_load_the_worker():  # the probe would see them: the test above can fail
    outcome, stderr = probe("--specialty", "sql_expert", "--base-model", "tiny-qwen2", "--speed-factor", "3")
    assert outcome["code"] == 2 and "--speed-factor must be in (0, 1]" in stderr
    assert "torch" in outcome["heavy"] and "worker.runner" in outcome["heavy"]
