#!/usr/bin/env python3
"""Flower's FedAvg over FedMoE's own trainer: the synchronous reference of bench/converge.py.

Every round the ServerApp sends the global LoRA adapter to every client; each ClientApp trains it for
``local-steps`` optimiser steps with ``worker.trainer.LoraTrainer`` (the FedMoE worker's trainer: same model,
LoRA settings, answer-token loss, AdamW, data order) on its own shard, and Flower's ``FedAvg`` takes the
sample-weighted mean of what comes back (McMahan et al., 2017). A client keeps its AdamW moments and its
place in its data between rounds in Flower's ``context.state``, as a FedMoE worker keeps them across pulls,
so the two arms differ only in how the updates are combined. The adapter after every round (round 0 is the
initial one) is written to ``out/round-NNN.safetensors`` for the benchmark to score.

Settings are one ``BaselineSettings``; the apps read them from the run config (its keys with dashes), so
both of Flower's engines run the same apps:

- simulation, in this process (``main`` below): ``flwr.simulation.run_simulation`` with the Ray backend, one
  client at a time (``--parallel 1``, one model copy in memory whatever the number of clients);
- deployment: a SuperLink and one SuperNode per client (``flower-supernode --node-config "partition-id=0
  num-partitions=3"``), ``flwr run`` on an app whose pyproject.toml names ``bench.flower_baseline:server_app``
  and ``bench.flower_baseline:client_app`` with this repository on PYTHONPATH, and the settings in its
  ``[tool.flwr.app.config]`` (``shards``, ``out``, ``rounds``, ``local-steps``, ...).

Flower is a benchmark-only dependency with its own virtualenv: flwr 1.42 needs protobuf < 7, typer < 0.21 and
packaging < 26, older than this project's environment has (``pip install --dry-run flwr==1.42.0`` would
downgrade them). Install it beside the project's packages (requirements-bench.txt says how)::

    python -m venv .venv-flower
    .venv-flower/bin/pip install -r requirements.txt -r requirements-bench.txt

    .venv-flower/bin/python -m bench.flower_baseline --shards DIR --out DIR --clients 3 --rounds 4 --local-steps 3
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from worker.data import Example, load_examples, split_examples
from models.loading import BaseModel, load_base_model
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

log = logging.getLogger("bench.flower_baseline")


@dataclass(frozen=True)
class BaselineSettings:
    """One FedAvg run; in a run config each field is its name with dashes (``local-steps = 3``)."""

    shards: str = ""
    """Directory of the clients' data: ``shard-<partition id>.jsonl`` (prompt, reference_code)."""
    out: str = ""
    """Directory the adapter after every round is written to (``round-NNN.safetensors`` + ``rounds.json``)."""
    clients: int = 3
    """Clients, all trained every round (FedAvg's fraction 1)."""
    rounds: int = 4
    local_steps: int = 3
    """Optimiser steps per client per round."""
    base_model: str = "smollm2-135m"
    lr: float = 1e-3
    batch_size: int = 8
    max_seq_len: int = 128
    lora_rank: int = 8
    lora_alpha: float = 16.0
    seed: int = 0
    """Seeds the initial LoRA A (as the FedMoE worker that creates the expert) and every client's data order."""
    threads: int = 1
    """torch threads of a client's training."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> BaselineSettings:
        """From a Flower run config (``local-steps``) or a mapping of field names; unknown keys are refused."""
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in config.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ValueError(f"unknown setting {key!r}; known: {', '.join(sorted(known))}")
            values[name] = type(getattr(cls(), name))(value)
        return cls(**values)

    def as_config(self) -> dict[str, Any]:
        """The run config that gives these settings (``from_config``'s inverse)."""
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)}

    def trainer(self, base: BaseModel, examples: list[Example]) -> LoraTrainer:
        """The FedMoE worker's trainer, on its own copy of ``base`` (a trainer wraps its model in place)."""
        own = dataclasses.replace(base, model=copy.deepcopy(base.model))
        return LoraTrainer(own, LoraSettings(rank=self.lora_rank, alpha=self.lora_alpha),
                           TrainSettings(lr=self.lr, batch_size=self.batch_size, max_seq_len=self.max_seq_len,
                                         seed=self.seed), examples)


@functools.lru_cache(maxsize=1)
def base_model(model_id: str) -> BaseModel:
    """Loaded once per process (a simulation's Ray actor serves every client in turn)."""
    return load_base_model(model_id)


def shard_examples(settings: BaselineSettings, partition: int) -> list[Example]:
    """A client's training examples: its shard less the held-out tenth a FedMoE worker keeps for its own check."""
    path = Path(settings.shards) / f"shard-{partition}.jsonl"
    return split_examples(load_examples(path))[0]


SETTINGS_ENV = "FEDMOE_FLOWER_SETTINGS"
"""JSON run config the simulation hands its apps (``run_simulation`` passes the apps no run config of their own;
Ray's workers inherit the environment). The engine's run config, if any, overrides it."""


def settings_of(context: Any) -> BaselineSettings:
    return BaselineSettings.from_config({**json.loads(os.environ.get(SETTINGS_ENV, "{}")), **context.run_config})


# client ------------------------------------------------------------------------------------------------


def train_round(settings: BaselineSettings, partition: int, adapter: dict[str, torch.Tensor],
                state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One client's round: ``local_steps`` steps from ``adapter``. ``state`` holds the client's AdamW moments and
    data position between rounds (``moments``: tensors, ``position``: epoch and index) and is updated."""
    torch.set_num_threads(settings.threads)
    trainer = settings.trainer(base_model(settings.base_model), shard_examples(settings, partition))
    trainer.load_adapter_state(adapter)
    if state.get("moments"):
        trainer.load_optimizer_state(_optimizer_state(trainer, state["moments"]))
        trainer.seek(type(trainer.data_position).from_dict(state["position"]))
    stats = trainer.train_steps(settings.local_steps)
    state["moments"] = {f"{index}.{key}": value.clone()
                        for index, moments in trainer.optimizer_state()["state"].items()
                        for key, value in moments.items()}
    state["position"] = trainer.data_position.to_dict()
    return trainer.adapter_state(), {"num-examples": stats.samples, "train-loss": stats.loss, "steps": stats.steps}


def _optimizer_state(trainer: LoraTrainer, moments: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The trainer's own AdamW state dict with its per-parameter state replaced by ``moments``."""
    state = trainer.optimizer_state()
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in moments.items():
        index, key = name.split(".", 1)
        per_param.setdefault(int(index), {})[key] = value
    return {"state": per_param, "param_groups": state["param_groups"]}


def _client_app() -> Any:
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        settings = settings_of(context)
        partition = int(context.node_config["partition-id"])
        state: dict[str, Any] = {}
        if "fedavg-moments" in context.state:  # kept by an earlier round (context.state is the client's own)
            state = {"moments": context.state["fedavg-moments"].to_torch_state_dict(),
                     "position": dict(context.state["fedavg-position"])}
        adapter, metrics = train_round(settings, partition, msg.content["arrays"].to_torch_state_dict(), state)
        context.state["fedavg-moments"] = ArrayRecord(state["moments"])
        context.state["fedavg-position"] = ConfigRecord(state["position"])
        return Message(RecordDict({"arrays": ArrayRecord(adapter), "metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


# server ------------------------------------------------------------------------------------------------


def initial_adapter(settings: BaselineSettings) -> dict[str, torch.Tensor]:
    """The adapter a FedMoE worker with this seed creates its expert from (A from the seed, B = 0)."""
    examples = shard_examples(settings, 0)
    return settings.trainer(base_model(settings.base_model), examples).adapter_state()


def save_round(settings: BaselineSettings, server_round: int, adapter: Mapping[str, torch.Tensor],
               replies: int) -> None:
    """``out/round-NNN.safetensors`` and a line in ``out/rounds.json``'s list (steps per client so far, and how
    many clients' updates the round averaged: FedAvg goes on with fewer when a client fails)."""
    from safetensors.torch import save_file

    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"round-{server_round:03d}.safetensors"
    save_file({k: v.contiguous() for k, v in adapter.items()}, str(out / name))
    index = out / "rounds.json"
    rounds = json.loads(index.read_text()) if index.is_file() else []
    rounds.append({"round": server_round, "file": name, "steps_per_client": server_round * settings.local_steps,
                   "replies": replies, "time": time.time()})
    index.write_text(json.dumps(rounds, indent=1) + "\n")


def _server_app() -> Any:
    from flwr.app import ArrayRecord, Context, MetricRecord, RecordDict
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        settings = settings_of(context)
        n = settings.clients
        replies = {"count": 0}

        def count_replies(records: list[RecordDict], key: str) -> MetricRecord:
            replies["count"] = len(records)
            return aggregate_metricrecords(records, key)

        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n,
                          train_metrics_aggr_fn=count_replies)

        def keep_round(server_round: int, arrays: ArrayRecord) -> None:
            save_round(settings, server_round, arrays.to_torch_state_dict(), n if server_round == 0 else replies["count"])
            replies["count"] = 0

        strategy.start(grid=grid, initial_arrays=ArrayRecord(initial_adapter(settings)), num_rounds=settings.rounds,
                       evaluate_fn=keep_round)

    return app


try:  # the deployment engine imports these names (pyproject: bench.flower_baseline:server_app, ...:client_app)
    server_app, client_app = _server_app(), _client_app()
except ImportError:  # no Flower here: the module's settings and train_round still import (bench/converge.py)
    server_app = client_app = None


# simulation ------------------------------------------------------------------------------------------


def run_simulation(settings: BaselineSettings, parallel: int = 1) -> float:
    """FedAvg with Flower's simulation engine in this process; the seconds it took. ``parallel`` clients at once."""
    from flwr.simulation import run_simulation as flower_simulation

    # Ray pickles the apps' functions by module: built under this module's own name, not __main__ (python -m)
    from bench import flower_baseline as named

    os.environ[SETTINGS_ENV] = json.dumps(settings.as_config())
    server, client = named._server_app(), named._client_app()
    cpus = max(1, parallel)
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
               "init_args": {"num_cpus": cpus, "include_dashboard": False, "logging_level": "ERROR",
                             "object_store_memory": 256 * 1024 * 1024}}
    started = time.monotonic()
    flower_simulation(server_app=server, client_app=client, num_supernodes=settings.clients, backend_config=backend)
    return time.monotonic() - started


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = BaselineSettings()
    for f in fields(BaselineSettings):
        default = getattr(defaults, f.name)
        p.add_argument("--" + f.name.replace("_", "-"), type=type(default), default=default,
                       required=f.name in ("shards", "out"))
    p.add_argument("--parallel", type=int, default=1, help="clients trained at once (each a model copy in memory)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    settings = BaselineSettings(**{f.name: getattr(args, f.name) for f in fields(BaselineSettings)})
    if not Path(settings.shards, "shard-0.jsonl").is_file():
        print(f"error: --shards {settings.shards!r} has no shard-0.jsonl", file=sys.stderr)
        return 2
    seconds = run_simulation(settings, args.parallel)
    log.info("%d rounds x %d clients x %d steps in %.0f s", settings.rounds, settings.clients, settings.local_steps,
             seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
