"""DS-1000's check in a sandbox: real harnesses, real child processes, each limit hit for real."""
import json
import os
import socket
import time
from pathlib import Path

import pytest

from gateway.sandbox import FAILED, PASSED, TIMEOUT, SandboxLimits, answer_code, pass_at_1, run_answer

ROOT = Path(__file__).resolve().parents[2]
RUN = "def test_execution(solution):\n    exec(solution, {})\n"
"""A minimal harness: the answer passes when it runs without an error."""


@pytest.fixture(scope="module")
def numpy_problem() -> dict:
    lines = (ROOT / "data" / "ds1000" / "heldout" / "numpy_expert.jsonl").read_text().splitlines()
    return json.loads(lines[0])


def test_the_reference_answer_passes_and_a_wrong_one_fails(numpy_problem):
    right = run_answer(numpy_problem["code_context"], numpy_problem["reference_code"])
    assert right.status == PASSED, right.detail
    wrong = run_answer(numpy_problem["code_context"], "result = None\n")
    assert wrong.status == FAILED and wrong.detail
    assert pass_at_1([right, wrong]) == 0.5


def test_an_answer_that_never_ends_is_killed_with_its_children(tmp_path):
    marker = tmp_path / "child-alive"
    child = f"import pathlib, time\nwhile True:\n    pathlib.Path({str(marker)!r}).touch()\n    time.sleep(0.1)\n"
    spawn = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {child!r}])\nwhile True: pass\n"
    started = time.monotonic()
    outcome = run_answer(RUN, spawn, SandboxLimits(seconds=3))
    assert outcome.status == TIMEOUT and time.monotonic() - started < 30
    if marker.exists():  # the child got to run: it must be dead now (its file no longer refreshed)
        seen = marker.stat().st_mtime
        time.sleep(0.5)
        assert marker.stat().st_mtime == seen


def test_an_answer_has_no_network():
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    outcome = run_answer(RUN, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n")
    assert outcome.status == FAILED and ("OSError" in outcome.detail or "Connection" in outcome.detail)
    with pytest.raises(TimeoutError):
        listener.accept()  # nothing reached this machine's loopback
    listener.close()
    subclassed = run_answer(RUN, "import socket\nclass S(socket.socket): pass\nS()\n")
    assert subclassed.status == FAILED and "no network" in subclassed.detail


def test_memory_and_file_size_are_capped_and_the_working_directory_is_temporary():
    big = run_answer(RUN, "x = bytearray(2 << 30)\n", SandboxLimits(memory_bytes=512 << 20))
    assert big.status == FAILED and "MemoryError" in big.detail
    huge = run_answer(RUN, "open('f', 'wb').write(b'x' * (4 << 20))\n", SandboxLimits(file_bytes=1 << 20))
    assert huge.status == FAILED
    wrote = run_answer(RUN, "import os\nopen('left-behind', 'w').write(os.getcwd())\n")
    assert wrote.status == PASSED and not os.path.exists("left-behind")


@pytest.mark.parametrize("text, code", [
    ("result = a.shape\n</code>\nEND SOLUTION", "result = a.shape"),
    ("```python\nresult = 1\n```\nThis sets result.", "result = 1"),
    ("<code>\nx = x[~np.isnan(x)]\nEND SOLUTION\n</code>", "x = x[~np.isnan(x)]"),
])
def test_answer_code_cuts_as_ds1000_does(text, code):
    assert answer_code(text) == code
