"""Worker identity against a real coordinator: a restarted worker gets its id back, a stranger does not."""
from __future__ import annotations

import os
import stat

import pytest

from protocol.client import CoordinatorClient, RetryPolicy
from protocol.credentials import WORKER_TOKENS_FILE, config_dir
from protocol.errors import Forbidden, TLSFailure
from protocol.tensors import dumps
from tests.e2e.test_security import BASE, self_signed
from tests.helpers import expert_spec, make_adapter, random_like, update_meta


def test_a_restarted_worker_renews_its_id_with_its_kept_token_and_a_stranger_cannot(start_coordinator, tmp_path,
                                                                                   monkeypatch):
    proc, url = start_coordinator()
    join = (tmp_path / "coordinator" / "join_token").read_text().strip()
    first = CoordinatorClient(url, token=join)  # a worker on another machine, given only the join token
    first.workers.register("w1", "e", BASE)
    first.experts.create("e", make_adapter(), expert_spec())
    kept = config_dir() / WORKER_TOKENS_FILE
    assert stat.S_IMODE(os.stat(kept).st_mode) == 0o600 and join not in kept.read_text()

    restarted = CoordinatorClient(url, token=join)  # the same machine after a restart: a new process
    restarted.workers.register("w1", "e", BASE)
    meta = update_meta()  # no worker_id: the token says who
    assert restarted.updates.push("e", dumps(random_like(make_adapter(), seed=5)), meta)["status"] in ("pending",
                                                                                                      "applied")
    assert {w["worker_id"]: w["updates_sent"] for w in restarted.workers.list()} == {"w1": 1}

    monkeypatch.setenv("FEDMOE_CONFIG_DIR", str(tmp_path / "elsewhere"))  # another machine, same join token
    with pytest.raises(Forbidden, match="another --worker-id"):
        CoordinatorClient(url, token=join).workers.register("w1", "e", BASE)
    CoordinatorClient(url, token=join).workers.register("w2", "e", BASE)
    assert "Traceback" not in "".join(proc.log)


def test_plain_http_to_a_tls_port_says_use_https(start_coordinator, tmp_path):
    cert, key = self_signed(tmp_path)
    _, url = start_coordinator("--tls-cert", str(cert), "--tls-key", str(key))
    plain = url.replace("https://", "http://")
    with pytest.raises(TLSFailure, match=f"speaks TLS.*use {url}"):
        CoordinatorClient(plain, retry=RetryPolicy(attempts=3, base_delay=5.0)).health()
    with pytest.raises(TLSFailure, match="does not answer TLS.*use http://"):  # and the other way round
        # a second coordinator needs its own data dir (coordinator/storage/data_dir.py)
        CoordinatorClient(start_coordinator(data_dir=tmp_path / "plain")[1].replace("http://", "https://")).health()
