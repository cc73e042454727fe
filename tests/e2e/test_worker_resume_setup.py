"""A worker restarted with other data or another codec on a checkpoint it left (worker-state/<id>).

Other data is refused in one line naming --fresh (the checkpoint's optimiser state, data position
and queued updates belong to the old data); another codec resumes, and the start-up line says so.
"""
from __future__ import annotations

import logging
import shutil

import pytest
import torch

import run_worker
from worker.checkpoint import MANIFEST
from worker.data import sample_dataset_path
from worker.runner import build_worker

COMMON = ["--specialty", "sql_expert", "--worker-id", "w1", "--base-model", "tiny-qwen2", "--batch-size", "2",
          "--max-seq-len", "64", "--lora-rank", "2"]
NOBODY = ["--coordinator-url", "http://127.0.0.1:9"]  # the resume decision comes before any network call


@pytest.fixture
def checkpoint(start_coordinator, tmp_path):
    """A state dir holding a topk+int8 checkpoint (with a residual) trained on a copy of the sample data."""
    _, url = start_coordinator()
    data, state = tmp_path / "sql.jsonl", tmp_path / "state"
    shutil.copy(sample_dataset_path("sql_expert"), data)
    args = run_worker.parse_args([*COMMON, "--dataset", str(data), "--state-dir", str(state), "--coordinator-url",
                                  url, "--compression", "topk+int8", "--compression-config", '{"ratio": 0.01}'])
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        worker, _, _ = build_worker(run_worker.build_config(args))
        worker.joining.join()
        worker.train_step()
        worker.sync()
    finally:
        torch.set_num_threads(previous)
    assert (state / MANIFEST).is_file() and worker.encoder.residual_norm() > 0
    return data, state


@pytest.fixture(autouse=True)
def restore_logging():
    """main() points the log handlers at this test's stderr; the next test must not write to a closed one."""
    handlers, level = logging.root.handlers[:], logging.root.level
    yield
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error: ")]


def test_a_checkpoint_trained_on_other_data_is_refused_until_fresh(checkpoint, tmp_path, capsys):
    data, state = checkpoint
    other = tmp_path / "other.jsonl"
    other.write_text("".join(data.read_text().splitlines(keepends=True)[:-1]))  # one example fewer
    manifest = (state / MANIFEST).read_bytes()
    capsys.readouterr()

    assert run_worker.main([*COMMON, "--dataset", str(other), "--state-dir", str(state), *NOBODY]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert f"--state-dir {state} holds a checkpoint of another setup (it was trained on {data}, --dataset now " \
           "has other content); pass --fresh to discard it" in line
    assert (state / MANIFEST).read_bytes() == manifest  # refused, not touched

    assert run_worker.main([*COMMON, "--dataset", str(other), "--state-dir", str(state), *NOBODY, "--fresh"]) == 2
    err = capsys.readouterr().err
    assert "--fresh: discarded the checkpoint" in err and "cannot reach the coordinator" in error_lines(err)[0]


def test_the_same_data_elsewhere_resumes_and_another_codec_is_said(checkpoint, tmp_path, capsys):
    data, state = checkpoint
    moved = tmp_path / "moved" / "renamed.jsonl"
    moved.parent.mkdir()
    shutil.copy(data, moved)  # same content, another path: the same dataset
    capsys.readouterr()

    assert run_worker.main([*COMMON, "--dataset", str(moved), "--state-dir", str(state), *NOBODY]) == 2
    err = capsys.readouterr().err
    (resumed,) = [line for line in err.splitlines() if "resuming the checkpoint in" in line]
    assert f"resuming the checkpoint in {state} (sync 1, step 1, expert version 0, 1 queued update(s), trained " \
           'with --compression topk+int8 {"ratio": 0.01}, now int8 {}; its residual (norm ' in resumed
    assert resumed.endswith(") goes into the next update); pass --fresh to start over")
    assert "cannot reach the coordinator" in error_lines(err)[0]  # resumed, then on to the network
