"""The README's own commands, typed verbatim from the root of a fresh copy of the repository.

Every other e2e test passes an absolute ``--data-dir`` in a temp dir, so none caught that the
default relative ``fedmoe-data`` made every weight download a 500 (Flask's ``send_file``
resolved it against the package folder). Here nothing is passed that a new user would not type:

    python run_coordinator.py --port 5000
    python run_worker.py --specialty python_expert --base-model tiny-qwen2
    python get_gateway_model.py --save-gateway
    python get_gateway_model.py --list-experts

``--base-model tiny-qwen2`` is the one flag added (the issue allows it: no model hub here). The
worker keeps its default ``--duration`` (an hour) and ``--sync-interval`` (10 s) and is stopped with
Ctrl-C (SIGINT) once it has synced twice; Ctrl-C ends with a final push, as a user would see.

``--save-gateway`` with no path (default ``gateway_model.npz`` in the working directory) is the
product brief's form.

The copy is made from ``git ls-files`` (tracked and new, not ignored, files of this checkout),
so no run-time file of the developer's tree (fedmoe-data/, worker-state/, *.npz) leaks in.
Port 5000 is what the defaults need: if it is taken the test fails saying so.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.e2e.conftest import LISTENING, ROOT, Process, ctrl_c_enabled

PORT = 5000
URL = f"http://127.0.0.1:{PORT}"
EXPERT = "python_expert"


def fresh_copy(dest: Path) -> Path:
    """The files a clone would hold (tracked, plus new files not ignored), copied from this checkout."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file() and not source.is_symlink():  # deleted in the work tree, or the .venv link
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def user_env() -> dict[str, str]:
    """A shell where ``python`` is the project's virtualenv, as after ``source .venv/bin/activate``."""
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDMOE_TOKEN")}
    return env | {"PATH": f"{venv_bin}{os.pathsep}{env.get('PATH', '')}", "HF_HUB_OFFLINE": "1",
                  "PYTHONUNBUFFERED": "1"}


def run(command: str, cwd: Path) -> Process:
    """Start ``command`` as a user types it (split on spaces, ``python`` found on PATH)."""
    proc = subprocess.Popen(command.split(), cwd=cwd, env=user_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=ctrl_c_enabled)  # Ctrl-C as in a terminal
    return Process(proc)


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def expert_version(headers: dict[str, str]) -> int:
    r = requests.get(f"{URL}/api/v1/experts/{EXPERT}", headers=headers, timeout=30)
    return r.json()["version"] if r.status_code == 200 else -1


@pytest.fixture
def clone(tmp_path) -> Path:
    if not port_is_free(PORT):
        pytest.fail(f"port {PORT} is in use: the documented commands need it (stop whatever listens there)")
    return fresh_copy(tmp_path / "FedMoE")


def test_the_documented_commands_work_from_a_fresh_clone(clone):
    coordinator = run("python run_coordinator.py --port 5000", clone)
    worker = None
    try:
        coordinator.wait_for(LISTENING, timeout=120)
        data_dir = clone / "fedmoe-data"
        assert (data_dir / "manifest.sqlite").is_file() and (data_dir / "blobs").is_dir(), sorted(clone.iterdir())
        headers = {"Authorization": f"Bearer {(data_dir / 'admin_token').read_text().strip()}"}

        worker = run(f"python run_worker.py --specialty {EXPERT} --base-model tiny-qwen2", clone)
        deadline = time.monotonic() + 300
        while expert_version(headers) < 2:  # the first sync pulls weights (the 500 of the issue), two pushes
            assert worker.proc.poll() is None, "".join(worker.log)
            assert time.monotonic() < deadline, "".join(worker.log)
            time.sleep(1)
        worker.proc.send_signal(signal.SIGINT)  # Ctrl-C: the worker pushes what it trained, then exits
        assert worker.proc.wait(timeout=120) == 0, "".join(worker.log)
        assert "Traceback" not in "".join(worker.log), "".join(worker.log)

        listed = subprocess.run("python get_gateway_model.py --list-experts".split(), cwd=clone, env=user_env(),
                                capture_output=True, text=True, timeout=300)
        assert listed.returncode == 0 and EXPERT in listed.stdout, listed.stdout + listed.stderr
        # Everything the coordinator keeps is under <clone>/fedmoe-data, nothing in the package folders.
        assert list((data_dir / "blobs").glob("??/*")), "no blob stored in the data dir"
        assert not (clone / "coordinator" / "fedmoe-data").exists()
        saved = subprocess.run("python get_gateway_model.py --save-gateway".split(), cwd=clone, env=user_env(),
                               capture_output=True, text=True, timeout=300)
        check_server_log(coordinator, worker)
        assert saved.returncode == 0, saved.stdout + saved.stderr
        assert (clone / "gateway_model.npz").stat().st_size > 1000, sorted(p.name for p in clone.iterdir())
    finally:
        if worker is not None and worker.proc.poll() is None:
            worker.proc.kill()
        coordinator.stop()
    check_server_log(coordinator, worker)


def check_server_log(coordinator: Process, worker: Process | None) -> None:
    """No 5xx: the coordinator logs each as "unhandled error (a bug)"; clients name the status they got."""
    log = "".join(coordinator.log)
    assert "unhandled error" not in log and "Traceback" not in log, log[-5000:]
    assert "HTTP 5" not in "".join(worker.log if worker else []), "".join(worker.log)
