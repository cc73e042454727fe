"""Audit findings: bad flags and files that gave a traceback, a message that did not name the flag, or an error
only after the process had started serving or training. Each must be one ``error:`` line, exit 2, before work.
main() runs in this process (tests.cli.test_cli.run with in_process=True, on a thread given two minutes): each
script's own process is checked in tests/cli/test_cli.py and tests/e2e/test_worker_cli.py."""
from __future__ import annotations

import pytest

from tests.cli.test_cli import one_error_line, run


@pytest.mark.slow  # may import torch
def test_results_that_is_a_directory_fails_before_training(tmp_path):
    # was: 20 s of training, then IsADirectoryError's traceback at the first sync (exit 1)
    line = one_error_line(run("run_worker.py", "--specialty", "python_expert", "--base-model", "tiny-qwen2",
                              "--results", str(tmp_path), "--duration", "3", in_process=True))
    assert line == f"error: --results {str(tmp_path)!r} is a directory; give a file name, e.g. " \
                   f"{str(tmp_path / 'results.jsonl')!r}"


@pytest.mark.slow
def test_results_under_a_file_fails_before_training(tmp_path):
    (tmp_path / "afile").write_text("x")
    line = one_error_line(run("run_worker.py", "--specialty", "python_expert", "--base-model", "tiny-qwen2",
                              "--results", str(tmp_path / "afile" / "r.jsonl"), in_process=True))
    assert line.startswith(f"error: --results {str(tmp_path / 'afile' / 'r.jsonl')!r}: ")
    assert line.endswith("is a file, not a directory")


@pytest.mark.slow
def test_dataset_that_is_an_empty_directory_says_so(tmp_path):
    # a directory may hold a dataset (save_to_disk, or data files); an empty one is a mistake worth naming early
    line = one_error_line(run("run_worker.py", "--specialty", "python_expert", "--dataset", str(tmp_path),
                              in_process=True))
    assert line.startswith(f"error: --dataset {str(tmp_path)!r} is an empty directory; pass a dataset file")


@pytest.mark.slow
@pytest.mark.parametrize("script, extra", [("run_worker.py", ["--specialty", "python_expert"]),
                                           ("get_gateway_model.py", [])])
@pytest.mark.parametrize("url, reason", [("http://[::1", "Invalid IPv6 URL"),
                                         ("http://127.0.0.1:99999", "Port out of range")])
def test_malformed_coordinator_url_names_the_flag(script, extra, url, reason):
    # was: "error: Invalid IPv6 URL" (no flag named); a port out of range went on to a connection attempt
    line = one_error_line(run(script, *extra, "--coordinator-url", url, in_process=True))
    assert line.startswith(f"error: --coordinator-url {url!r} is not a valid URL (")
    assert reason in line


@pytest.mark.slow
def test_max_steps_zero_fails_before_loading_the_model():
    line = one_error_line(run("run_worker.py", "--specialty", "python_expert", "--base-model", "tiny-qwen2",
                              "--max-steps", "0", in_process=True))
    assert line == "error: --max-steps must be at least 1, got 0"


@pytest.mark.slow
def test_coordinator_threads_zero_fails_before_listening(tmp_path):
    result = run("run_coordinator.py", "--port", "0", "--threads", "0", "--data-dir", str(tmp_path / "d"),
                 in_process=True)
    assert one_error_line(result) == "error: --threads must be at least 1, got 0"
    assert not (tmp_path / "d").exists()


@pytest.mark.slow
def test_admin_token_file_that_is_a_directory_names_the_flag(tmp_path):
    result = run("run_coordinator.py", "--port", "0", "--admin-token-file", str(tmp_path), "--data-dir",
                 str(tmp_path / "d"), in_process=True)
    assert one_error_line(result).startswith(f"error: --admin-token-file {str(tmp_path)!r} is a directory")
    assert not (tmp_path / "d").exists()


@pytest.mark.slow
@pytest.mark.parametrize("url, reason", [("http://[::1", "Invalid IPv6 URL"), ("http://h:99999", "Port out of range")])
def test_malformed_upstream_is_one_line_before_anything_is_written(tmp_path, url, reason):
    # was: the data dir made, a connection attempt, then "cannot reach the upstream ...: InvalidURL"
    result = run("run_coordinator.py", "--port", "0", "--upstream", url, "--data-dir", str(tmp_path / "d"),
                 in_process=True)
    line = one_error_line(result)
    assert line.startswith(f"error: --upstream {url!r} is not a valid URL (") and reason in line
    assert not (tmp_path / "d").exists()
