"""run_worker.py answers bad flags and files with one readable line, never a traceback.

One case runs ``python run_worker.py`` in a process of its own (the script's own path: imports, exit code, no
traceback, through a model load); the others call its ``main()`` in the test process (tests.helpers.run_main),
which saves the ~5 CPU s each process spends importing torch, transformers and peft."""
import subprocess
import sys

import pytest

import run_worker as script
from tests import launcher
from tests.e2e.conftest import ROOT, env
from tests.helpers import run_main

FROM_THE_SHELL = "cannot reach the coordinator"
"""The case run as its own process (forked from tests/launcher.py: tests/cli/test_worker_startup.py runs the
script from the shell): it goes furthest (flags, data, model load, the first request). 300 s is a
deadline, not a speed check: on a machine at load 12 the imports alone took over 60 s and the old 90 s ran out."""


def run_worker(*args: str, timeout: float = 300, in_process: bool = True) -> subprocess.CompletedProcess:
    if in_process:
        code, stdout, stderr = run_main(script.main, *args)
        return subprocess.CompletedProcess(["run_worker.py", *args], code, stdout, stderr)
    return launcher.run([sys.executable, str(ROOT / "run_worker.py"), *args], cwd=ROOT, env=env(),
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["--specialty", "cooking_expert", "--base-model", "tiny-qwen2"], "pass --dataset"),
    (["--specialty", "python_expert", "--dataset", "nowhere.jsonl"], "does not exist"),
    (["--specialty", "python expert"], "--specialty must be 1-64 characters"),
    (["--specialty", "python_expert", "--coordinator-url", "localhost:5000"], "not an http(s) address"),
    (["--specialty", "python_expert", "--compression", "zip"], "valid codecs"),
    (["--specialty", "python_expert", "--compression", "topk", "--compression-config", "{bad"], "not valid JSON"),
    (["--specialty", "python_expert", "--compression", "topk", "--compression-config", '{"ratio": 7}'],
     "ratio must be in (0, 1]"),
    (["--specialty", "python_expert", "--speed-factor", "3"], "--speed-factor"),
    (["--specialty", "python_expert", "--base-model", "qwen/Qwen2-0.5B-Instruct"], "--base-model tiny-qwen2"),
    (["--specialty", "python_expert", "--base-model", "tiny-qwen2", "--coordinator-url", "http://127.0.0.1:9"],
     "cannot reach the coordinator"),
])
def test_bad_input_is_one_clear_line(args, message):
    result = run_worker(*args, in_process=message != FROM_THE_SHELL)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], result.stderr


def test_bad_dataset_line_names_the_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "a", "reference_code": "b"}\n{"prompt": "c"}\n')
    result = run_worker("--specialty", "x", "--dataset", str(data), "--base-model", "tiny-qwen2")
    assert result.returncode == 2 and "line 2" in result.stderr and "Traceback" not in result.stderr


def test_a_directory_without_a_model_is_one_line_naming_what_is_wanted(tmp_path):
    result = run_worker("--specialty", "python_expert", "--base-model", str(tmp_path), "--threads", "1",
                        "--coordinator-url", "http://127.0.0.1:9")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert f"base model directory {str(tmp_path)!r} has no config.json" in error
    assert "config.json, the weights" in error and error.endswith("`--base-model smollm2-135m` (after `make smollm2`).")
