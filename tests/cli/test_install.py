"""`pip install .` into a fresh virtualenv gives the four commands, the scripts and the packages, outside the checkout.

Quick by design: --no-deps and --no-build-isolation, with this environment's site-packages on the new one's path
(a .pth file), so nothing is downloaded; the source is copied first so the build leaves nothing in the checkout.
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {"fedmoe-coordinator": "run_coordinator", "fedmoe-worker": "run_worker",
            "fedmoe-gateway": "get_gateway_model", "fedmoe-serve": "serve"}
PACKAGES = ("coordinator", "worker", "gateway", "serving", "models", "compression", "protocol", "privacy")
NOT_INSTALLED = ("tests", "bench", "scripts")  # checkout-only: the suite, the benchmarks, the docs generator
SOURCES = ("pyproject.toml", "README.md", "requirements", "data", *(f"{m}.py" for m in COMMANDS.values()), *PACKAGES)


def test_pyproject_installs_every_package_and_script_of_the_checkout():
    """A package or script added at the top of the checkout but not to pyproject.toml would be missing from an
    install while every test run from the checkout still passes."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - set(NOT_INSTALLED)
    assert packages == set(PACKAGES)
    assert {f"{name}*" for name in (*packages, "data")} == set(setuptools["packages"]["find"]["include"])
    scripts = {p.stem for p in ROOT.glob("*.py")}
    assert scripts == set(setuptools["py-modules"]) == set(COMMANDS.values())
    assert project["project"]["scripts"] == {command: f"{module}:main" for command, module in COMMANDS.items()}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtualenv with the project installed; its bin directory."""
    tmp = tmp_path_factory.mktemp("install")
    (tmp / "src").mkdir()
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tmp / "src" / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, tmp / "src" / name)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "shared.pth").write_text(site.getsitepackages()[0] + "\n")  # pip, setuptools, torch, ...
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           "--no-deps", "--no-build-isolation", "--no-index", str(tmp / "src")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return venv / "bin"


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return env | {"HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_each_console_script_answers_help(installed, command, tmp_path):
    proc = subprocess.run([str(installed / command), "--help"], cwd=tmp_path, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: {command} ") and "--version" in proc.stdout


@pytest.mark.slow
def test_the_packages_scripts_and_sample_data_come_from_the_install(installed, tmp_path):
    """Found, not imported (torch and transformers take a minute to import on a loaded machine): every package and
    script is the installed copy, and the sample data the tiny-qwen2 preset trains its tokenizer on sits beside
    them."""
    modules = (*PACKAGES, *COMMANDS.values())
    code = f"import importlib.util as u; print(*(u.find_spec(m).origin for m in {modules!r}))"
    proc = subprocess.run([str(installed / "python"), "-c", code], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    origins = dict(zip(modules, (Path(p) for p in proc.stdout.split()), strict=True))
    assert all(p.is_relative_to(installed.parent) for p in origins.values()), origins
    data = origins["worker"].parents[1] / "data"  # models/presets.py and worker/data.py look for it there
    assert sorted(p.name for p in data.glob("*.jsonl")) == sorted(p.name for p in (ROOT / "data").glob("*.jsonl"))
    assert (data / "ds1000" / "train" / "pandas_expert.jsonl").is_file()
    assert (origins["coordinator"].parent / "static" / "dashboard.html").is_file()
    version = subprocess.run([str(installed / "fedmoe-worker"), "--version"], cwd=tmp_path, env=clean_env(),
                             capture_output=True, text=True, timeout=120)
    assert version.stdout.startswith("FedMoE ") and version.returncode == 0
