"""The coordinator as users run it: its own server on a loopback port, real HTTP, the gateway CLI."""
import json
import subprocess
import sys

import numpy as np
import requests
import torch

import get_gateway_model
from protocol.client import CoordinatorClient, RetryPolicy
from protocol.errors import InvalidPayload, NotFound, Unavailable
from protocol.tensors import dumps
from tests import launcher
from tests.e2e.conftest import ROOT, admin_headers, env
from tests.helpers import expert_spec, make_adapter, random_like, run_main, update_meta


def run_gateway_tool(*args: str, in_process: bool = True) -> subprocess.CompletedProcess:
    """get_gateway_model.py with ``args``: its main() in this process (tests.helpers.run_main: no ~2-4 CPU s of
    imports per call), or as a process of its own (``in_process=False``: the script's own path, exit code, no
    traceback; test_gateway_tool_gives_one_clear_line_when_unreachable and tests/cli run it so)."""
    if in_process:
        code, stdout, stderr = run_main(get_gateway_model.main, *args)
        return subprocess.CompletedProcess(["get_gateway_model.py", *args], code, stdout, stderr)
    return launcher.run([sys.executable, str(ROOT / "get_gateway_model.py"), *args], cwd=ROOT, env=env(),
                        capture_output=True, text=True, timeout=300)


def test_push_pull_and_save_gateway_over_real_http(start_coordinator, tmp_path):
    proc, url = start_coordinator()
    client = CoordinatorClient(url)
    adapter = make_adapter()
    assert client.experts.create("python_expert", adapter, expert_spec())["version"] == 0
    delta = random_like(adapter, 1)
    meta = update_meta(num_samples=5)
    assert client.updates.push("python_expert", dumps(delta), meta)["applied_version"] == 1
    assert client.updates.push("python_expert", dumps(delta), meta)["applied_version"] == 1  # retry: once

    pulled = client.experts.pull("python_expert")
    assert pulled.version == 1
    assert all(torch.allclose(pulled.tensors[k], adapter[k] + delta[k]) for k in adapter)
    assert client.experts.pull("python_expert", etag=pulled.etag).tensors is None  # 304

    listing = run_gateway_tool("--coordinator-url", url, "--list-experts")
    assert listing.returncode == 0
    header, row, _, workers = listing.stdout.splitlines()
    assert header.split()[:3] == ["name", "version", "updates"] and row.split()[:4] == ["python_expert", "1", "1", "5"]
    assert workers == "no workers yet"

    out = tmp_path / "gateway_model.npz"
    saved = run_gateway_tool("--coordinator-url", url, "--save-gateway", str(out))
    assert saved.returncode == 0, saved.stderr
    npz = np.load(out, allow_pickle=False)
    key = next(iter(adapter))
    assert npz[key].shape[0] == 2  # one expert of rank 2: the exact gateway keeps rank 2
    assert not list(tmp_path.glob(".*.part"))

    from bench.wan import contributions  # reads the version events' alpha and staleness grace

    assert contributions(url, 0.1) == {meta["update_id"]: {"updates": 1, "staleness_median": 0, "staleness_max": 0,
                                                           "share": 1.0}}


def test_bad_input_over_http_is_4xx_and_server_survives(start_coordinator):
    proc, url = start_coordinator()
    client = CoordinatorClient(url)
    client.experts.create("e", make_adapter(), expert_spec())
    try:
        client.updates.push("e", b"\x80\x04not safetensors", update_meta())
    except InvalidPayload as exc:
        assert "safetensors" in str(exc)
    else:
        raise AssertionError("a pickle-like body was accepted")
    try:
        client.experts.pull("nobody")
    except NotFound as exc:
        assert "nobody" in str(exc)
    else:
        raise AssertionError("unknown expert answered")
    r = requests.post(f"{url}/api/v1/experts/e/updates", data=b"x" * 100, headers=admin_headers(url), timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"
    assert client.health()["status"] == "ok"


def test_restart_on_the_same_data_dir_keeps_everything(start_coordinator, tmp_path):
    proc, url = start_coordinator()
    client = CoordinatorClient(url)
    adapter = make_adapter()
    client.experts.create("e", adapter, expert_spec())
    client.updates.push("e", dumps(random_like(adapter, 1)), update_meta())
    before = client.experts.pull("e")
    proc.stop()

    _, url = start_coordinator()
    after = CoordinatorClient(url).experts.pull("e")
    assert after.version == before.version == 1 and after.etag == before.etag


def test_gateway_tool_gives_one_clear_line_when_unreachable():
    result = run_gateway_tool("--coordinator-url", "http://127.0.0.1:9", "--list-experts", in_process=False)
    assert result.returncode == 2
    assert result.stderr.startswith("error: cannot reach the coordinator at http://127.0.0.1:9")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_gateway_tool_rejects_unknown_extension(start_coordinator, tmp_path):
    _, url = start_coordinator()
    CoordinatorClient(url).experts.create("e", make_adapter(), expert_spec())
    result = run_gateway_tool("--coordinator-url", url, "--save-gateway", str(tmp_path / "g.pt"))
    assert result.returncode == 2 and ".npz" in result.stderr and not (tmp_path / "g.pt").exists()


def test_client_gives_up_with_unavailable():
    client = CoordinatorClient("http://127.0.0.1:9", retry=RetryPolicy(attempts=2, base_delay=0.01))
    try:
        client.health()
    except Unavailable as exc:
        assert "gave up after 2 tries" in str(exc)
    else:
        raise AssertionError("no error from a closed port")


def test_port_in_use_is_one_clear_error(start_coordinator, tmp_path):
    _, url = start_coordinator()
    port = url.rsplit(":", 1)[1]
    result = launcher.run([sys.executable, str(ROOT / "run_coordinator.py"), "--host", "127.0.0.1",
                           "--port", port, "--data-dir", str(tmp_path / "other")],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "cannot listen" in result.stderr and "Traceback" not in result.stderr


def test_gateway_tool_exports_experts_and_local_merges(start_coordinator, tmp_path):
    _, url = start_coordinator()
    client = CoordinatorClient(url)
    a, b = make_adapter(seed=1), make_adapter(seed=2)
    client.experts.create("a", a, expert_spec())
    client.experts.create("b", b, expert_spec())

    out = tmp_path / "a.safetensors"
    result = run_gateway_tool("--coordinator-url", url, "--save-gateway", str(out), "--expert", "a")
    assert result.returncode == 0, result.stderr
    from protocol.tensors import load_file
    got = load_file(out)
    assert all(torch.equal(got[k], a[k]) for k in a)

    out = tmp_path / "ties.npz"
    result = run_gateway_tool("--coordinator-url", url, "--save-gateway", str(out), "--strategy", "ties",
                              "--strategy-config", '{"density": 0.5}')
    assert result.returncode == 0, result.stderr
    meta = json.loads(str(np.load(out, allow_pickle=False)["__fedmoe__"]))
    assert meta["strategy"] == "ties" and meta["config"]["density"] == 0.5 and meta["merged_locally"]

    again = run_gateway_tool("--coordinator-url", url, "--save-gateway", str(out))
    assert again.returncode == 2 and "--overwrite" in again.stderr

    peft_dir = tmp_path / "peft"
    result = run_gateway_tool("--coordinator-url", url, "--save-gateway", str(peft_dir), "--format", "peft")
    assert result.returncode == 0, result.stderr
    assert (peft_dir / "adapter_config.json").is_file() and (peft_dir / "adapter_model.safetensors").is_file()

    bad = run_gateway_tool("--coordinator-url", url, "--save-gateway", str(tmp_path / "x.npz"), "--expert", "nobody")
    assert bad.returncode == 2 and "nobody" in bad.stderr and "Traceback" not in bad.stderr
