"""Flower's FedAvg through its deployment engine over bench.wan's emulated sites: the synchronous baseline.

A SuperLink runs on this host's loopback where FedMoE's root runs; each site's link (``bench.wanemu.WanLink``: tbf
and the delay proxy) leads to it, and one SuperNode per worker runs inside the site's namespace, partition k
training on shard k (``bench.wan_setup.write_shards``), the shards the FedMoE workers get. ``flwr run`` starts
``bench.flower_baseline``'s ServerApp and ClientApp (FedAvg, McMahan et al. 2017, over ``worker.trainer.LoraTrainer``:
the same model, LoRA, answer-token loss, AdamW, lr, batch and sequence length as the FedMoE workers), rounds of
``local_steps`` optimiser steps per client, fraction 1, every client every round: FlowerTune's recipe shape (its LLM
templates train a fixed number of local steps per round on a LoRA adapter and average with FedAvg).

Flower 1.42 speaks HTTP between SuperNode and SuperLink, so the delay proxy carries it as it carries FedMoE's
requests, and the proxy counts the bytes. Its SuperNodes start a fresh ``flwr-clientapp`` process for every round's
message (isolation ``subprocess``, the default): each round pays Python, torch and the model's load again; that is
the deployment engine as shipped, and it is timed like everything else. Every process a SuperNode or the SuperLink
starts stays in a cgroup (capped at ``--worker-cpu`` for the SuperNodes, as FedMoE's workers), so the run ends with
all of them killed.

Flower needs its own virtualenv (``.venv-flower``, requirements-bench.txt: flwr 1.42 pins older protobuf and typer
than this project's environment has). The adapter after every round is written by the ServerApp to
``out/round-NNN.safetensors`` with its time (``rounds.json``); those are the versions bench.wan evaluates.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.wan_setup import ROOT, CpuGroup, Settings, cpu_capped
from bench.wanemu import WanLink

FLOWER_VENV = ROOT / ".venv-flower"
INSTALL_HINT = ("python -m venv .venv-flower && .venv-flower/bin/pip install -r requirements.txt "
                "-r requirements-bench.txt")


class FlowerUnavailable(RuntimeError):
    """No Flower virtualenv here: the Flower modes cannot run."""


def check_flower() -> None:
    if not (FLOWER_VENV / "bin" / "flower-superlink").is_file():
        raise FlowerUnavailable(f"the Flower modes need flwr in {FLOWER_VENV} ({INSTALL_HINT})")


@dataclass(frozen=True)
class FlowerRun:
    local_steps: int
    """Optimiser steps per client per round (the round length this mode sweeps)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def app_dir(directory: Path, config: dict[str, Any]) -> Path:
    """A Flower app naming bench.flower_baseline's apps, with ``config`` as its run config."""
    directory.mkdir(parents=True, exist_ok=True)
    values = "\n".join(f"{key} = {json.dumps(value)}" for key, value in config.items())
    (directory / "pyproject.toml").write_text(f"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedmoe-fedavg"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedmoe"

[tool.flwr.app.components]
serverapp = "bench.flower_baseline:server_app"
clientapp = "bench.flower_baseline:client_app"

[tool.flwr.app.config]
{values}
""")
    return directory


def flower_home(directory: Path, superlink: str) -> Path:
    """A FLWR_HOME whose default SuperLink connection is ``superlink`` (host:port, plain HTTP)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.toml").write_text(f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\n'
                                           f'address = "{superlink}"\ninsecure = true\n')
    return directory


def flower_env(base: dict[str, str], home: Path) -> dict[str, str]:
    # the SuperLink and SuperNodes start flower-superexec, flwr-serverapp and flwr-clientapp by name: the venv's bin
    return {**base, "PATH": f"{FLOWER_VENV / 'bin'}:{base.get('PATH', '')}", "FLWR_HOME": str(home),
            "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited {proc.returncode} before listening")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"flower-superlink did not listen on {port} within {timeout:.0f} s")


def read_rounds(out: Path) -> list[dict[str, Any]]:
    try:
        return list(json.loads((out / "rounds.json").read_text()))
    except (OSError, ValueError):  # not written yet, or being rewritten
        return []


def training_start(rounds: list[dict[str, Any]]) -> float | None:
    """When the clients began their first round's training, estimated: round 1's end less one round's length.

    Round 0 is saved when the ServerApp starts, before any client has loaded the model; FedMoE's clock starts at the
    expert's creation, once its first worker has loaded it. The later rounds' median length is what a round costs
    once running (a fresh ClientApp process each round included), so this start leaves out the first load and nothing
    else. None until round 2 has ended (round 1's own length holds the first load)."""
    if len(rounds) < 3:
        return None
    ends = [r["time"] for r in rounds[1:]]
    lengths = sorted(b - a for a, b in zip(ends, ends[1:]))
    return max(rounds[0]["time"], ends[0] - lengths[len(lengths) // 2])


def run_flower(name: str, run: FlowerRun, s: Settings, scratch: Path, shards: list[Path], out: Path) -> dict[str, Any]:
    """One FedAvg run of ``s.worker_count`` SuperNodes in ``s.sites`` sites; bytes, steps and the rounds' adapters
    (written to ``out``, kept until they are scored)."""
    check_flower()
    port = free_port()
    home = flower_home(scratch / "flwr-home", f"127.0.0.1:{port}")
    env = flower_env(dict(os.environ), home)
    config = {"shards": str(shards[0].parent), "out": str(out), "clients": s.worker_count, "rounds": 100_000,
              "local-steps": run.local_steps, "base-model": s.base_model, "batch-size": s.batch_size,
              "max-seq-len": s.max_seq_len, "threads": s.threads or 1, **({"lr": s.lr} if s.lr else {})}
    app = app_dir(scratch / "app", config)
    with ExitStack() as stack:
        root_group = stack.enter_context(cpu_capped("flower-root", None))
        groups = [root_group]
        link_log = (scratch / "superlink.log").open("w")
        stack.callback(link_log.close)
        superlink = subprocess.Popen([str(FLOWER_VENV / "bin" / "flower-superlink"), "--insecure", "--host", "127.0.0.1",
                                      "--port", str(port), "--disable-runtime-dependency-installation"],
                                     env=env, cwd=scratch, stdout=link_log, stderr=subprocess.STDOUT)
        root_group(superlink.pid)
        try:
            wait_for_port(port, superlink, timeout=300)
            links = [stack.enter_context(WanLink(("127.0.0.1", port), *s.site_link(i))) for i in range(s.sites)]
            started = time.monotonic()
            for site, link in enumerate(links):
                for i in range(s.workers):
                    k = site * s.workers + i
                    group = stack.enter_context(cpu_capped(f"flower-{site}-{i}", s.worker_share(k)))
                    groups.append(group)
                    start_supernode(link, k, s, scratch, env, group)
            submit = subprocess.run([str(FLOWER_VENV / "bin" / "flwr"), "run", str(app), "bench", "--format", "json"],
                                    env=env, cwd=scratch, capture_output=True, text=True, timeout=600)
            if submit.returncode != 0:
                raise RuntimeError(f"{name}: flwr run failed: {submit.stdout[-1500:]} {submit.stderr[-1500:]}")
            rounds = wait_for_rounds(out, s, superlink)
            wall = time.monotonic() - started
            ingress = sum(link.proxy.bytes_to_target for link in links)
            egress = sum(link.proxy.bytes_to_client for link in links)
        finally:
            for group in groups:  # every process Flower started, detached sessions included
                group.kill()
            superlink.wait()
            time.sleep(0.5)  # the kernel empties a group once its killed processes are reaped
    return flower_row(name, run, s, rounds, out, ingress, egress, wall)


def start_supernode(link: WanLink, partition: int, s: Settings, scratch: Path, env: dict[str, str],
                    group: CpuGroup) -> None:
    """SuperNode ``partition`` inside the site, connected to the SuperLink through the site's link."""
    address = link.url.split("://", 1)[1]
    node_home = flower_home(scratch / f"node-{partition}", address)
    with (scratch / f"supernode-{partition}.log").open("w") as node_log:
        proc = link.site.popen([str(FLOWER_VENV / "bin" / "flower-supernode"), "--insecure", "--superlink", address,
                                "--port", str(19500 + partition),  # its ClientApp API, on the namespace's loopback
                                "--node-config", f"partition-id={partition} num-partitions={s.worker_count}"],
                               env={**env, "FLWR_HOME": str(node_home)}, cwd=scratch, stdout=node_log,
                               stderr=subprocess.STDOUT)
    group(proc.pid)  # before it starts its SuperExec and ClientApps: they stay in the group (and under its cap)


def wait_for_rounds(out: Path, s: Settings, superlink: subprocess.Popen) -> list[dict[str, Any]]:
    """Rounds until ``s.duration`` seconds of training have passed (from ``training_start``), or start-up's bound."""
    deadline = time.monotonic() + s.duration + 900  # start-up under load, as FedMoE's modes allow
    while time.monotonic() < deadline:
        if superlink.poll() is not None:
            raise RuntimeError(f"flower-superlink exited {superlink.returncode}")
        rounds = read_rounds(out)
        start = training_start(rounds)
        if start is not None and time.time() >= start + s.duration:
            return rounds
        time.sleep(1.0)
    rounds = read_rounds(out)
    if len(rounds) < 2:
        raise RuntimeError(f"Flower finished no round within {s.duration + 900:.0f} s")
    return rounds


def flower_row(name: str, run: FlowerRun, s: Settings, rounds: list[dict[str, Any]], out: Path, ingress: int,
               egress: int, wall: float) -> dict[str, Any]:
    """The mode's figures in bench.wan's row shape; each round's adapter is a version (seconds from training_start)."""
    start = training_start(rounds) or rounds[0]["time"]
    versions = [{"version": r["round"], "seconds": max(0.0, r["time"] - start) if r["round"] else 0.0,
                 "file": str(out / r["file"])} for r in rounds if r["time"] <= start + s.duration]
    done = versions[-1]["version"]
    lengths = [b["time"] - a["time"] for a, b in zip(rounds[1:], rounds[2:])]
    return {"mode": name, "engine": "flower", "root": {"aggregation": "fedavg (Flower)", "local_steps": run.local_steps},
            "syncs": done * s.worker_count, "steps_total": done * run.local_steps * s.worker_count,
            "steps_per_worker": done * run.local_steps, "rounds": done,
            "round_seconds_median": round(sorted(lengths)[len(lengths) // 2], 2) if lengths else None,
            "first_round_seconds": round(rounds[1]["time"] - rounds[0]["time"], 1),
            "root_ingress_bytes": ingress, "root_egress_bytes": egress, "wall_seconds": round(wall, 1),
            "link_busy_up": round(ingress / s.link_capacity(wall), 3),
            "link_busy_down": round(egress / s.link_capacity(wall), 3),
            "relays": [], "step_clock": [[v["seconds"], v["version"] * run.local_steps] for v in versions],
            "versions": versions}
