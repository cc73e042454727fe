"""The three scripts' command lines: --version, --help with examples, and one-line errors (exit 2).

--version and --help call main() in-process, since argparse prints them before any work starts. Errors
run each script once as users do, in a process of its own (run_coordinator.py: a port in use;
get_gateway_model.py: an unreachable coordinator; run_worker.py: tests/e2e/test_worker_cli.py), which
checks the script's own path: its imports, exit code 2 and no traceback. The other error cases call
main() in this process (``run(..., in_process=True)``; a process costs 2-6 CPU s of imports each),
on a thread given two minutes: a script that went on to serve or train instead of refusing fails there.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from typing import Any

import pytest

import get_gateway_model
import run_coordinator
import run_worker
from protocol.version import __version__
from tests.e2e.conftest import ROOT, env
from tests.helpers import run_main

SCRIPTS = {"run_coordinator.py": run_coordinator, "run_worker.py": run_worker,
           "get_gateway_model.py": get_gateway_model}


def run(script: str, *args: str, in_process: bool = False) -> subprocess.CompletedProcess:
    if not in_process:
        return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=env(), capture_output=True,
                              text=True, timeout=90)
    done: dict[str, Any] = {}

    def call() -> None:
        try:
            done["result"] = run_main(SCRIPTS[script].main, *args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test below
            done["error"] = exc

    thread = threading.Thread(target=call, name=f"main of {script}", daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), f"{script} {' '.join(args)} still runs after 120 s instead of refusing its flags"
    if "error" in done:
        raise done["error"]
    code, stdout, stderr = done["result"]
    return subprocess.CompletedProcess([script, *args], code, stdout, stderr)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_version_and_help_with_examples(script, capsys):
    module = SCRIPTS[script]
    with pytest.raises(SystemExit) as exit_version:
        module.main(["--version"])
    assert exit_version.value.code == 0 and capsys.readouterr().out == f"FedMoE {__version__}\n"
    with pytest.raises(SystemExit):
        module.main(["--help"])
    text = capsys.readouterr().out
    assert "Examples:" in text and f"python {script} --" in text and "--log-format {text,json}" in text


@pytest.mark.slow  # a real process
def test_port_in_use_names_the_flag(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_error_line(run("run_coordinator.py", "--host", "127.0.0.1", "--port", str(port),
                                  "--data-dir", str(tmp_path / "data")))
    assert line == (f"error: cannot listen on 127.0.0.1:{port}: Address already in use "
                    "(is another server running there? pick another --port)")


@pytest.mark.slow  # imports torch
@pytest.mark.parametrize("script, args, message", [
    ("run_coordinator.py", ["--gateway-weights", "python_expert=heavy"], "--gateway-weights: expected NAME=WEIGHT"),
    ("run_coordinator.py", ["--gateway-strategy", "ties", "--gateway-config", '{"p": 0.5}'],
     "--gateway-config: unknown config key 'p' for merge 'ties'; valid keys: density, lam, rank"),
    ("run_coordinator.py", ["--gateway-strategy", "dare", "--gateway-config", '{"p": 1.5}'],
     "--gateway-config: p must be in [0, 1), got 1.5"),
    ("run_coordinator.py", ["--gateway-config", "density=0.2"], "--gateway-config is not valid JSON"),
    ("run_coordinator.py", ["--upstream", "ftp://root"], "--upstream must be an http(s):// URL"),
    ("run_coordinator.py", ["--upstream", "http://127.0.0.1:9", "--forward-compression", "nope"],
     "--forward-compression 'nope'"),
    ("get_gateway_model.py", ["--coordinator-url", "http://127.0.0.1:9"],
     "cannot reach the coordinator at http://127.0.0.1:9"),
    ("get_gateway_model.py", ["--coordinator-url", "127.0.0.1:5000"], "not an http(s) address; use e.g. http://"),
    ("get_gateway_model.py", ["--strategy", "ties", "--strategy-config", "{density: 1}", "--save-gateway", "g.npz"],
     "--strategy-config is not valid JSON"),
])
def test_errors_are_one_line_with_the_fix(script, args, message):
    assert message in one_error_line(run(script, *args, in_process=True))


@pytest.mark.parametrize("args, message", [
    (["--compression", "auto"], "error: --compression auto needs --sync-budget SECONDS"),
    (["--compression", "int8", "--sync-budget", "2"], "error: --sync-budget applies to --compression auto only, got "
                                                      "--compression int8"),
    (["--compression", "auto", "--sync-budget", "0"], "error: --sync-budget must be a positive number of seconds"),
])
def test_worker_refuses_a_sync_budget_out_of_place_before_loading_torch(args, message):
    """The rules are worker.choices.check_sync_budget's, which CompressionSettings applies too (one copy)."""
    assert one_error_line(run("run_worker.py", "--specialty", "sql_expert", *args, in_process=True)).startswith(message)


@pytest.mark.slow  # real processes
def test_unreachable_coordinator_says_what_to_check_and_json_errors_are_json():
    result = run("get_gateway_model.py", "--coordinator-url", "http://127.0.0.1:9", "--log-format", "json")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    entry = json.loads(line)
    assert entry["level"] == "ERROR" and entry["message"].endswith("check --coordinator-url")


def test_list_experts_table_is_aligned():
    experts = [{"name": "python_expert", "version": 12, "updates_applied": 12, "samples_seen": 960,
                "lora": {"rank": 8}, "last_train_loss": 4.03321, "updated_at": 0.0},
               {"name": "sql", "version": 3, "updates_applied": 140, "samples_seen": 24, "lora": {"rank": 16},
                "last_train_loss": None, "updated_at": 0.0}]
    header, first, second = get_gateway_model.experts_table(experts).splitlines()
    assert header.startswith("name           version  updates  samples  rank  last loss")
    # names left-aligned, numbers right-aligned: every column ends where its header ends
    for column in ("version", "updates", "samples", "rank", "last loss"):
        end = header.index(column) + len(column)
        assert first[end - 1] != " " and second[end - 1] != " " and first[end] == second[end] == " ", column
    assert second.split()[:6] == ["sql", "3", "140", "24", "16", "-"]


def test_list_experts_shows_the_privacy_spent():
    private = {"name": "p", "version": 2, "updates_applied": 2, "samples_seen": 8, "lora": {"rank": 8},
               "last_train_loss": None, "updated_at": 0.0,
               "privacy": {"dp_fedavg": {"epsilon": 3.14159, "delta": 1e-05, "budget": 8.0, "steps": 2},
                           "dp_sgd": {"w1": {"epsilon": 2.5, "delta": 1e-06, "steps": 9},
                                      "w2": {"epsilon": 7.25, "delta": 1e-06, "steps": 30}}}}
    table = get_gateway_model.experts_table([private])
    assert table.splitlines()[0].endswith("privacy (eps, delta)")
    assert table.splitlines()[1].endswith("worker-level (3.14 of 8, 1e-05); DP-SGD up to (7.25, 1e-06) over 2 worker(s)")
    assert get_gateway_model.privacy_cell(None) == "-"
