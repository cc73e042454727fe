"""The local credentials file: same-machine clients find a coordinator's token by host and port."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading

import pytest

from protocol import credentials
from protocol.client import CoordinatorClient
from protocol.credentials import local_token, publish_local_token, resolve_token, withdraw_local_token


@pytest.fixture(autouse=True)
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDMOE_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.delenv("FEDMOE_TOKEN", raising=False)
    return tmp_path / "cfg"


def test_a_published_token_is_found_under_every_local_name_of_its_port(config_dir):
    publish_local_token("0.0.0.0", 5123, "tok-a")
    for url in ("http://127.0.0.1:5123", "http://localhost:5123/", "https://LOCALHOST:5123"):
        assert local_token(url) == "tok-a", url
    assert local_token("http://127.0.0.1:5124") is None
    assert local_token("http://10.1.2.3:5123") is None
    assert stat.S_IMODE(os.stat(config_dir / "credentials.json").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(config_dir).st_mode) == 0o700
    withdraw_local_token("0.0.0.0", 5123)
    assert local_token("http://127.0.0.1:5123") is None


def test_a_coordinator_bound_to_loopback_is_only_found_there():
    publish_local_token("127.0.0.1", 6000, "tok")
    assert local_token("http://localhost:6000") == "tok"
    assert credentials.local_names("127.0.0.1") == ["127.0.0.1", "localhost"]


def test_entries_of_dead_processes_are_ignored_and_pruned(config_dir):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    path = config_dir / "credentials.json"
    config_dir.mkdir(mode=0o700)
    path.write_text(json.dumps({"127.0.0.1:7000": {"token": "stale", "pid": int(dead)}}))
    assert local_token("http://127.0.0.1:7000") is None
    publish_local_token("127.0.0.1", 7001, "fresh")  # any write drops what dead processes left
    assert set(json.loads(path.read_text())) == {"127.0.0.1:7001", "localhost:7001"}


def test_a_new_coordinator_on_a_port_replaces_the_old_entry_and_withdraw_keeps_others():
    publish_local_token("127.0.0.1", 7100, "old")
    publish_local_token("127.0.0.1", 7100, "new")
    publish_local_token("127.0.0.1", 7101, "neighbour")
    assert local_token("http://127.0.0.1:7100") == "new"
    withdraw_local_token("127.0.0.1", 7100)
    assert local_token("http://127.0.0.1:7100") is None and local_token("http://127.0.0.1:7101") == "neighbour"


def test_concurrent_coordinators_all_keep_their_entries():
    threads = [threading.Thread(target=publish_local_token, args=("127.0.0.1", 8000 + i, f"t{i}")) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [local_token(f"http://127.0.0.1:{8000 + i}") for i in range(12)] == [f"t{i}" for i in range(12)]


def test_resolution_order_is_flag_then_environment_then_local_file(monkeypatch):
    publish_local_token("127.0.0.1", 9000, "from-file")
    url = "http://127.0.0.1:9000"
    assert resolve_token(url)[0] == "from-file"
    monkeypatch.setenv("FEDMOE_TOKEN", "from-env")
    assert resolve_token(url) == ("from-env", "FEDMOE_TOKEN")
    assert resolve_token(url, "from-flag") == ("from-flag", "--token")
    monkeypatch.delenv("FEDMOE_TOKEN")
    assert resolve_token("http://127.0.0.1:9001")[0] is None


def test_a_corrupt_file_counts_as_empty_and_is_rewritten(config_dir):
    config_dir.mkdir(mode=0o700)
    (config_dir / "credentials.json").write_text("{not json")
    assert local_token("http://127.0.0.1:5000") is None
    publish_local_token("127.0.0.1", 5000, "tok")
    assert local_token("http://127.0.0.1:5000") == "tok"


def test_a_client_made_before_its_coordinator_started_finds_the_token_later():
    client = CoordinatorClient("http://127.0.0.1:9100")
    assert client.transport.token is None
    publish_local_token("127.0.0.1", 9100, "late")
    assert client.transport.token == "late"
    publish_local_token("127.0.0.1", 9100, "restarted-on-a-new-data-dir")
    assert client.transport.token == "restarted-on-a-new-data-dir"
    assert CoordinatorClient("http://127.0.0.1:9100", token="given").transport.token == "given"
