"""The --threads budget: torch and the OpenMP/BLAS variables follow it; bad values are one clear line."""
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT, env

PROBE = """
import os, torch
from worker.threads import apply_thread_budget
apply_thread_budget({threads})
print(torch.get_num_threads(), torch.get_num_interop_threads(), os.environ.get("OMP_NUM_THREADS"))
"""


@pytest.mark.slow  # imports torch in a fresh interpreter
@pytest.mark.parametrize("threads", [1, 3])
def test_a_budget_sets_torch_threads_and_the_openmp_variable(threads):
    out = subprocess.run([sys.executable, "-c", PROBE.format(threads=threads)], cwd=ROOT, env=env(),
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out == [str(threads), str(threads), str(threads)]


@pytest.mark.slow  # imports torch in a fresh interpreter
def test_no_budget_keeps_torchs_default():
    probe = PROBE.format(threads=None)
    environment = {k: v for k, v in env().items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], cwd=ROOT,
                         env=environment, capture_output=True, text=True, timeout=120, check=True).stdout.split()
    budgeted = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=environment, capture_output=True,
                              text=True, timeout=120, check=True).stdout.split()
    assert budgeted[0] == out[0] and budgeted[2] == "None"


@pytest.mark.parametrize("value", ["0", "-2"])
def test_run_worker_refuses_a_budget_below_one(value):
    result = subprocess.run([sys.executable, str(ROOT / "run_worker.py"), "--specialty", "python_expert",
                             "--base-model", "tiny-qwen2", "--threads", value], cwd=ROOT, env=env(),
                            capture_output=True, text=True, timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(errors) == 1 and "--threads must be at least 1" in errors[0], result.stderr
