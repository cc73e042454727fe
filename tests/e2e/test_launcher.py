"""tests/launcher.py: a forked script behaves as the same script started by subprocess would."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from tests import launcher
from tests.e2e.conftest import env

PROBE = """
import json, os, signal, sys, time
import numpy
print(json.dumps({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
                  "marker": os.environ.get("FEDMOE_PROBE"), "sigint": str(signal.getsignal(signal.SIGINT)),
                  "sigchld": int(signal.getsignal(signal.SIGCHLD)), "draw": float(numpy.random.rand())}))
print("to stderr", file=sys.stderr)
if sys.argv[1:] == ["wait"]:
    sys.stdout.flush()
    time.sleep(600)
raise SystemExit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(PROBE)
    return path


def test_a_forked_script_gets_its_argv_cwd_environment_streams_and_exit_code(probe, tmp_path):
    runs = [launcher.run([sys.executable, str(probe), "3"], cwd=tmp_path, env=env() | {"FEDMOE_PROBE": str(n)},
                         capture_output=True, text=True, timeout=120) for n in range(2)]
    assert all(isinstance(r, subprocess.CompletedProcess) and r.returncode == 3 for r in runs), runs
    assert [r.stderr for r in runs] == ["to stderr\n"] * 2
    seen = [json.loads(r.stdout) for r in runs]
    for n, s in enumerate(seen):
        assert (s["name"], s["argv"], s["cwd"], s["path0"], s["marker"]) == (
            "__main__", [str(probe), "3"], str(tmp_path), str(probe.parent), str(n))
        assert s["sigint"].endswith("default_int_handler>") and s["sigchld"] == int(signal.SIG_DFL)
    assert seen[0]["draw"] != seen[1]["draw"]  # each fork reseeds numpy, as a fresh interpreter would


def test_a_forked_script_is_signalled_and_waited_for_like_a_popen(probe, tmp_path):
    proc = launcher.popen([sys.executable, str(probe), "wait"], cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
    assert isinstance(proc, launcher.LaunchedProcess)  # forked, not a plain subprocess
    assert json.loads(proc.stdout.readline())["argv"][1] == "wait"
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.terminate()
    assert proc.wait(timeout=60) == -signal.SIGTERM and proc.returncode == -signal.SIGTERM
    proc.kill()  # after the end: nothing to signal, no error (as Popen)
    proc.stdout.close()


def test_tests_share_one_launcher(probe, tmp_path, monkeypatch):
    """pytest names the running test in PYTEST_CURRENT_TEST: a launcher per test would import ~10 CPU s each."""
    launchers = []
    for n in range(2):
        monkeypatch.setenv("PYTEST_CURRENT_TEST", f"test {n}")
        assert launcher.run([sys.executable, str(probe), "0"], env=env(), capture_output=True, timeout=120).returncode == 0
        launchers.append(len(launcher._launchers))
    assert launchers[1] == launchers[0]  # was one more: a launcher for the second test's environment


def test_any_other_command_is_a_plain_subprocess(tmp_path):
    done = launcher.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "42\n")
    with launcher.popen(["true"]) as proc:
        assert isinstance(proc, subprocess.Popen)
