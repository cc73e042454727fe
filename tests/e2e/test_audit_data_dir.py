"""Audit finding: a relay (or a second root) started on a running root's data dir destroyed it.

What was sent: on the root's machine, in the same working directory, the relay example of docs/cli.md
(``run_coordinator.py --upstream http://root --port ...``, no --data-dir, so the root's default ``fedmoe-data``).
What came back: the relay's start-up sweep deleted every blob it did not know (the root's expert versions); the
root then answered 404 for its expert's weights, and the root's next start quarantined the expert (acknowledged
updates lost). Fix: coordinator/storage/data_dir.py (a lock per data dir, and a root's dir is never a relay's).
"""
from __future__ import annotations

import json
import subprocess
import sys

import requests

from tests import launcher
from tests.e2e.conftest import ROOT, admin_headers, env
from tests.helpers import expert_spec, make_adapter
from protocol.schemas import EXPERT_HEADER
from protocol.tensors import dumps


def _run_coordinator(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return launcher.run([sys.executable, str(ROOT / "run_coordinator.py"), "--host", "127.0.0.1", "--port", "0",
                         *args], env=env(), capture_output=True, text=True, timeout=timeout)


def _create_expert(url: str) -> bytes:
    body = dumps(make_adapter(seed=3))
    answer = requests.put(f"{url}/api/v1/experts/python_expert", data=body, timeout=30,
                          headers=admin_headers(url) | {EXPERT_HEADER: json.dumps(expert_spec())})
    assert answer.status_code == 201, answer.text
    return body


def _weights(url: str) -> requests.Response:
    return requests.get(f"{url}/api/v1/experts/python_expert/weights", headers=admin_headers(url), timeout=30)


def test_relay_on_a_running_roots_data_dir_is_refused_and_deletes_nothing(start_coordinator, tmp_path):
    data_dir = tmp_path / "coordinator"
    _, url = start_coordinator(data_dir=data_dir)
    _create_expert(url)
    blobs = sorted(p.name for p in (data_dir / "blobs").rglob("*") if p.is_file() and p.parent.name != "tmp")
    (tmp_path / "join").write_text((data_dir / "join_token").read_text())

    relay = _run_coordinator("--upstream", url, "--join-token-file", str(tmp_path / "join"),
                             "--data-dir", str(data_dir))

    assert relay.returncode == 2, relay.stdout + relay.stderr
    assert "Traceback" not in relay.stderr
    assert "holds a root coordinator's data" in relay.stderr
    assert set(blobs) <= {p.name for p in (data_dir / "blobs").rglob("*") if p.is_file()}  # (+ a gateway build)
    assert not (data_dir / "relay.sqlite").exists()
    assert _weights(url).status_code == 200


def test_second_root_on_a_running_roots_data_dir_is_refused(start_coordinator, tmp_path):
    data_dir = tmp_path / "coordinator"
    _, url = start_coordinator(data_dir=data_dir)
    _create_expert(url)

    second = _run_coordinator("--data-dir", str(data_dir))

    assert second.returncode == 2
    assert second.stderr.strip().splitlines()[-1].startswith("error: --data-dir")
    assert "in use by another coordinator or relay (pid " in second.stderr
    assert _weights(url).status_code == 200


def test_relay_refuses_a_stopped_roots_data_dir(start_coordinator, tmp_path):
    data_dir = tmp_path / "coordinator"
    root, url = start_coordinator(data_dir=data_dir)
    body = _create_expert(url)
    (tmp_path / "join").write_text((data_dir / "join_token").read_text())
    other, other_url = start_coordinator(data_dir=tmp_path / "other-root")

    relay = _run_coordinator("--upstream", other_url, "--join-token-file", str(tmp_path / "join"),
                             "--data-dir", str(data_dir))
    root.stop()

    assert relay.returncode == 2
    assert "holds a root coordinator's data (manifest.sqlite)" in relay.stderr
    _, url = start_coordinator(data_dir=data_dir)  # the root restarts on it with its expert intact
    assert _weights(url).content == body


def test_data_dir_that_is_a_file_is_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")

    result = _run_coordinator("--data-dir", str(afile))

    assert result.returncode == 2
    assert result.stderr.strip() == f"error: --data-dir {str(afile)!r} is a file; give a directory (it is created " \
                                    "if missing)"
    assert afile.read_text() == "x"
