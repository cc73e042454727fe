"""Schemathesis fuzzes a live coordinator from the OpenAPI description it serves: no 5xx, ever.

The server is the real run_coordinator.py, seeded with the resources the description's
examples name (expert python_expert, worker worker-1, update worker-1:0001, a routing profile), so
generated requests reach real data and not only 404s. Examples per operation are limited to keep
the run to ~20 s; `schemathesis run URL/api/v1/openapi.json` without -n fuzzes longer.
"""
from __future__ import annotations

import json
import subprocess
import sys

import requests

from coordinator.api.openapi import OPENAPI
from gateway.router import profile_to_json, text_profile
from protocol.schemas import EXPERT_HEADER, UPDATE_HEADER
from protocol.tensors import dumps
from tests.e2e.conftest import admin_headers
from tests.helpers import expert_spec, make_adapter, random_like, update_meta

EXAMPLES = 15


def seed(url: str) -> None:
    api, auth = url + "/api/v1", admin_headers(url)
    adapter = make_adapter()
    spec = expert_spec() | {"worker_id": "worker-1"}
    assert requests.put(f"{api}/experts/python_expert", data=dumps(adapter),
                        headers={**auth, EXPERT_HEADER: json.dumps(spec)}, timeout=30).status_code == 201
    worker = {"worker_id": "worker-1", "specialty": "python_expert", "base_model": spec["base_model"]}
    assert requests.post(f"{api}/workers", json=worker, headers=auth, timeout=30).status_code == 200
    meta = update_meta(worker_id="worker-1") | {"update_id": "worker-1:0001"}
    assert requests.post(f"{api}/experts/python_expert/updates", data=dumps(random_like(adapter, 1)),
                         headers={**auth, UPDATE_HEADER: json.dumps(meta)}, timeout=30).status_code == 202
    profile = profile_to_json(text_profile(["def add(a, b): return a + b"]), 1)
    assert requests.put(f"{api}/experts/python_expert/profiles/worker-1", json=profile, headers=auth,
                        timeout=30).status_code == 200


def test_schemathesis_finds_no_server_error(start_coordinator, tmp_path):
    coordinator, url = start_coordinator("--max-body-mb", "1")
    seed(url)
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/api/v1/openapi.json",
         "--checks", "not_a_server_error", "--max-examples", str(EXAMPLES), "--seed", "1",
         "--header", f"Authorization: {admin_headers(url)['Authorization']}",
         "--generation-database", "none", "--workers", "1", "--no-color", "--request-timeout", "30"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240)
    summary = run.stdout[-4000:]
    assert run.returncode == 0, summary + run.stderr[-2000:]
    # Every operation was fuzzed (schemathesis leaves out one of ours: the description itself).
    n = sum(len(methods) for methods in OPENAPI["paths"].values())
    assert f"Selected: {n - 1}/{n - 1}" in summary and f"Tested: {n - 1}" in summary, summary
    assert "unhandled error" not in "".join(coordinator.log), "".join(coordinator.log)[-4000:]
