"""With --use-proxy, a proxy nobody answers on is named in the error; the coordinator is not blamed."""
import argparse
import socket

import pytest

from protocol.cli import report_error
from protocol.client import CoordinatorClient, RetryPolicy
from protocol.errors import Unavailable


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dead_proxy(monkeypatch) -> int:
    port = closed_port()
    for var in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HTTP_PROXY", f"http://alice:secret@127.0.0.1:{port}")
    return port


def test_a_dead_proxy_is_named_without_its_password(dead_proxy, capsys):
    client = CoordinatorClient(f"http://127.0.0.1:{closed_port()}", use_proxy=True,
                               retry=RetryPolicy(attempts=2, base_delay=0.01))
    with pytest.raises(Unavailable) as caught:
        client.health()
    message = str(caught.value)
    assert message.startswith(f"cannot reach the coordinator through the proxy http://127.0.0.1:{dead_proxy} ")
    assert "secret" not in message and "drop --use-proxy" in message
    report_error(argparse.Namespace(log_format="text"), caught.value)
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: cannot reach the coordinator through the proxy")
    assert "check --coordinator-url" not in line  # the coordinator's address is not what is wrong


def test_without_use_proxy_the_environment_is_ignored_and_the_coordinator_is_the_suspect(dead_proxy, capsys):
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(Unavailable) as caught:
        CoordinatorClient(url, retry=RetryPolicy(attempts=1)).health()
    assert str(caught.value).startswith(f"cannot reach the coordinator at {url}: connection refused")
    report_error(argparse.Namespace(log_format="text"), caught.value)
    assert "check --coordinator-url" in capsys.readouterr().err
