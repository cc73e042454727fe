"""The bad-input matrix against a real coordinator process: every case is a 4xx with a JSON error.

One run_coordinator.py serves the whole module, with --max-body-mb 1 so the oversized
cases are cheap. Each case sends one bad request for expert ``e`` (or about it); afterwards the
expert must be exactly where the setup left it, and the server log must hold no unhandled error.
Pushes carry the admin token (found the way same-machine clients find it) unless a case is about
tokens; the coordinator runs with --norm-check reject so an outsized update is one of the cases.
An expired token is tested in tests/e2e/test_security.py (it needs a coordinator with a short TTL).
"""
from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import requests

from bench.bad_inputs import ADAPTER, CASES, FIRST_BODY, REPLAYED, SERVER_FLAGS, Server
from protocol.tensors import dumps
from tests.e2e.conftest import LISTENING, ROOT, Process, spawn
from tests.helpers import expert_spec


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory) -> Iterator[tuple[Process, Server]]:
    data_dir = tmp_path_factory.mktemp("bad-inputs")
    process = spawn(str(ROOT / "run_coordinator.py"), "--host", "127.0.0.1", "--port", "0",
                    "--data-dir", str(data_dir), *SERVER_FLAGS)
    s = Server(process.wait_for(LISTENING).group(1), (data_dir / "join_token").read_text().strip())
    assert s.put_expert("e", dumps(ADAPTER), expert_spec()).status_code == 201
    assert s.put_expert("other", dumps(ADAPTER), expert_spec()).status_code == 201
    assert s.push(FIRST_BODY, REPLAYED).status_code == 202  # expert e is now at version 1
    yield process, s
    process.stop()


@pytest.fixture(scope="module")
def server(coordinator) -> Server:
    return coordinator[1]


@pytest.fixture(scope="module")
def answers(server):
    """Every bad request of CASES sent once, in order: {name: answer} (the checks below need all of them sent,
    whichever of them pytest selected)."""
    return {name: send(server) for name, send, _ in CASES}


@pytest.mark.parametrize("name, status", [pytest.param(c[0], c[2], id=c[0]) for c in CASES])
def test_bad_input_is_a_4xx_with_a_json_error(answers, name, status):
    response = answers[name]
    code, body = ((response.status_code, response.content) if isinstance(response, requests.Response)
                  else response)
    assert code == status, (name, code, body[:500])
    error = json.loads(body)["error"]
    assert isinstance(error["code"], str) and error["message"], error


def test_nothing_bad_was_applied_and_the_replay_with_the_same_body_is_still_200(coordinator, server, answers):
    info = server.get("/experts/e").json()
    assert (info["version"], info["updates_applied"], info["samples_seen"]) == (1, 1, 3)
    assert server.push(FIRST_BODY, REPLAYED).status_code == 200  # retries stay idempotent
    experts = {e["name"] for e in server.get("/experts").json()["experts"]}
    assert experts == {"e", "other", "big"}  # "big": made by the overflow case, left at version 1
    big = server.get("/experts/big").json()
    assert (big["version"], big["updates_applied"], big["pending_updates"]) == (1, 1, 0)
    log = "".join(coordinator[0].log)
    assert "unhandled error" not in log and "Traceback" not in log, log[-3000:]
