"""What a new user meets first: instant --help, the documented commands' defaults, a usable start hint,
quiet exports, plain log files with real debug lines."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from coordinator.choices import AGGREGATION_NAMES, ROBUST_NAMES
from coordinator.config import CoordinatorConfig
from coordinator.http.listening import announce, reachable_urls
from gateway.choices import DEFAULT_ROUTE_THRESHOLD, MERGE_NAMES
from protocol.client import CoordinatorClient
from tests.e2e.conftest import ROOT, env, start_coordinator  # noqa: F401 - a fixture
from tests.helpers import expert_spec, make_adapter

HEAVY = ("torch", "transformers", "flask", "gunicorn", "peft", "requests", "numpy")


def imported_by(script: str, *args: str) -> tuple[int, list[str]]:
    """Run ``script``'s main(args) in a fresh interpreter: (exit code, heavy modules it imported)."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import {script} as m\n"
            f"try:\n    m.main({list(args)!r})\nexcept SystemExit as e:\n    status = e.code\n"
            f"print(status, [n for n in {HEAVY!r} if n in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True,
                         timeout=300).stdout.strip().splitlines()[-1]
    status, modules = out.split(" ", 1)
    return int(status), eval(modules)  # noqa: S307 - our own print of a list of names


@pytest.mark.parametrize("script", ["run_coordinator", "run_worker", "get_gateway_model", "serve"])
@pytest.mark.parametrize("args, status", [(["--help"], 0), (["--no-such-flag"], 2), (["--log-format", "xml"], 2)])
def test_help_and_flag_errors_import_nothing_heavy(script, args, status):
    assert imported_by(script, *args) == (status, [])


def test_bad_choices_are_flag_errors_before_any_heavy_import():
    assert imported_by("run_coordinator", "--aggregation", "fedprox") == (2, [])
    assert imported_by("get_gateway_model", "--strategy", "mean") == (2, [])


def test_the_light_name_lists_are_the_registries_keys():
    from coordinator.aggregation import AGGREGATORS, ROBUST_RULES
    from gateway.merges import MERGES
    from gateway.router import DEFAULT_THRESHOLD

    assert set(AGGREGATION_NAMES) == set(AGGREGATORS) and set(ROBUST_NAMES) == set(ROBUST_RULES)
    assert list(MERGE_NAMES) == sorted(MERGES)
    assert DEFAULT_ROUTE_THRESHOLD == DEFAULT_THRESHOLD


def test_save_gateway_without_a_path_writes_gateway_model_npz_here(start_coordinator, tmp_path):  # noqa: F811
    _, url = start_coordinator()
    adapter = make_adapter()
    CoordinatorClient(url).experts.create("e", adapter, expert_spec())
    here = tmp_path / "somewhere"
    here.mkdir()
    result = subprocess.run([sys.executable, str(ROOT / "get_gateway_model.py"), "--coordinator-url", url,
                             "--save-gateway"], cwd=here, env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "saved gateway (weighted_average), rank 2, as npz to gateway_model.npz"
    assert result.stderr == ""
    with np.load(here / "gateway_model.npz", allow_pickle=False) as saved:
        assert {k for k in saved.files if k.endswith("lora_A.weight")} == {k for k in adapter
                                                                          if k.endswith("lora_A.weight")}
    assert not (ROOT / "gateway_model.npz").exists()


def test_the_start_hint_gives_addresses_a_worker_can_connect_to(caplog, tmp_path):
    local, remote = reachable_urls("http://0.0.0.0:5000")
    assert local == "http://127.0.0.1:5000" and remote.startswith("http://") and remote.endswith(":5000")
    assert "0.0.0.0" not in remote and "127.0.0.1" not in remote
    assert reachable_urls("https://127.0.0.1:8443") == ("https://127.0.0.1:8443", None)
    assert reachable_urls("http://10.1.2.3:5000") == ("http://10.1.2.3:5000", "http://10.1.2.3:5000")
    with caplog.at_level(logging.INFO, logger="coordinator.http.listening"):
        announce(CoordinatorConfig(data_dir=tmp_path), "http://0.0.0.0:5000")
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "0.0.0.0" not in text
    assert "--coordinator-url http://127.0.0.1:5000 --specialty NAME (no token needed)" in text
    assert f"--coordinator-url {remote} --specialty NAME" in text and "join_token" in text


def test_debug_logs_one_line_per_request_and_every_decision(tmp_path, caplog):
    from coordinator.api.app import create_app

    app = create_app(CoordinatorConfig(data_dir=tmp_path / "data"))
    try:
        # The "coordinator" logger itself: a benchmark run in-process earlier may have quietened it.
        with caplog.at_level(logging.DEBUG, logger="coordinator"):
            client = app.test_client()
            assert client.get("/api/v1/experts").status_code == 200
            assert app.test_client(token=None).get("/api/v1/workers").status_code == 401
            from tests.helpers import put_expert
            assert put_expert(client, "e", make_adapter()).status_code == 201
    finally:
        app.extensions["fedmoe"].close()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(line.startswith("GET /api/v1/experts -> 200 (admin, ") for line in lines), lines
    assert any(line.startswith("GET /api/v1/workers -> 401 (-, ") for line in lines), lines
    assert any(line.startswith("request_refused: GET /api/v1/workers from unknown@") for line in lines), lines
    assert any(line.startswith("expert_created: expert e created") for line in lines), lines


def test_merged_export_and_generate_print_no_warning_and_no_progress_bar(tmp_path, capfd):
    from gateway.export import save_merged_model
    from gateway.generate import generate
    from tests.gateway.test_export import random_expert
    from models.loading import LORA_PROJECTIONS, load_base_model

    base = load_base_model("tiny-qwen2")
    with warnings.catch_warnings():  # building the test adapter calls peft directly: its notice is not ours
        warnings.simplefilter("ignore", FutureWarning)
        tensors = random_expert(seed=1)
    lora = {"rank": 2, "alpha": 4.0, "target_modules": list(LORA_PROJECTIONS)}
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_merged_model(tmp_path / "merged", base.model, base.tokenizer, tensors, lora)
        generate(base.model, base.tokenizer, "hello", tensors, lora, max_new_tokens=2)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    err = capfd.readouterr().err
    assert "Writing model shards" not in err and "it/s" not in err
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "qwen2"
    assert Path(tmp_path / "merged").is_dir()


def test_nothing_in_the_repository_cites_a_file_a_clone_lacks():
    """The project began from a design document beside the repository; a user's clone has neither it nor the
    folder it lived in, so a citation of either is a dead end."""
    absent = ("DESIGN" + ".md", "../" + "shared")
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    cited = [(name, word) for name in files.decode().split("\0")
             if name and name.endswith((".py", ".md", ".txt", ".toml", ".ini", ".cfg", ".sh", ".html", "Makefile"))
             and (ROOT / name).is_file() for word in absent if word in (ROOT / name).read_text(errors="replace")]
    assert not cited, cited


def test_the_architecture_page_names_every_package():
    """docs/architecture.md is the map: a package it does not name is one a newcomer cannot place."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True).stdout
    packages = sorted(name.rsplit("/", 1)[0] for name in files.splitlines()
                      if name.endswith("/__init__.py") and not name.startswith("tests/"))
    leaves = [name.rsplit("/", 1)[-1] + "/" for name in packages]
    assert packages and not [name for name, leaf in zip(packages, leaves) if leaf not in text], packages
    assert "```mermaid" in text and "BLAKE3" in text and "SHA-256" not in text
