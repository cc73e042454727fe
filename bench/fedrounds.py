"""Synchronous federated rounds in one process: real trainers, real codecs, real aggregation rules.

What the coordinator and workers do over HTTP, minus the HTTP (which the quality suites do not
measure): every round each worker starts from the expert's weights (plus its own undelivered
error-feedback residual, as ``worker.federation`` keeps it), takes ``steps`` AdamW steps on its
own shard, and sends its delta through ``worker.encoding.UpdateEncoder`` (the codec and error
feedback the worker uses; what the coordinator decodes is ``EncodedUpdate.sent``). The coordinator's
rule then makes the next version: FedBuff over the round's updates (``coordinator.aggregation``,
sample-weighted, staleness 0), FedAsync (the coordinator's default: each update added as it arrives)
or a ``--robust`` rule, each scaled by the coordinator's ``--server-lr`` (``FedJob.server_lr``). An
attacker replaces what it sends.

Server learning rate: FedBuff with server lr 1 applies the *mean* of K workers' deltas, so a round
of K workers x s steps moves the expert about as far as s sequential steps, not K * s. Server lr K
applies their sum (FedBuff, Nguyen et al. 2022, and FedOpt, Reddi et al. 2021, tune a server step
size for the same reason).
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


from bench.realdata import Lab, loss_pair
from coordinator.aggregation import AGGREGATORS, AggregationParams, Update, robust_aggregator
from protocol.tensors import StateDict, manifest_of
from worker.data import Example
from worker.encoding import CompressionSettings, UpdateEncoder

Attack = Callable[[StateDict], StateDict]
ATTACKS: dict[str, Attack] = {
    "sign_flip": lambda delta: {k: -4.0 * t for k, t in delta.items()},
    "scale": lambda delta: {k: 10.0 * t for k, t in delta.items()},
}
"""What an attacker sends instead of an honest delta (as bench/byzantine.py)."""


@dataclass(frozen=True)
class FedJob:
    """One federated run of one expert."""

    shards: tuple[tuple[Example, ...], ...]
    """One shard of training examples per honest worker."""
    rounds: int
    steps: int
    """AdamW steps per worker per round."""
    seed: int = 0
    """Worker i trains with seed + i (data order); the expert's LoRA init comes from seed."""
    compression: CompressionSettings = field(default_factory=lambda: CompressionSettings("safetensors"))
    """Lossless by default (the fp32 arm the quality benches compare codecs against), not the worker's int8."""
    codec_seed: int = 0
    aggregation: str = "fedbuff"
    """The coordinator's --aggregation: fedbuff (the round's sample-weighted mean) or fedasync (each update
    added as it arrives, weighted 1 / (1 + 0.1 * staleness); the i-th of a round has staleness i)."""
    robust: str = "none"
    """'none' or a coordinator --robust rule (buffered rounds)."""
    server_lr: float = 1.0
    """The coordinator's --server-lr: the step size on each aggregated delta."""
    attack: str | None = None
    """Key of ATTACKS: one extra worker sends worker 0's honest delta, attacked."""
    track: tuple[Example, ...] = ()
    """Examples whose loss is measured after every round (rounds to a target)."""
    lr: float | None = None
    """Every worker's AdamW learning rate (the worker's --lr; None: the preset's recommended one)."""
    fresh_optimizer: bool = False
    """Each worker starts every round with fresh AdamW moments. The product keeps them across pulls
    (``LoraTrainer.load_adapter_state``), as the default here does; this measures the alternative."""
    snapshot_every: int = 0
    """Keep the expert's weights after every that many rounds (0: none), in ``FedResult.snapshots`` keyed by
    the total optimiser steps all workers took so far (round x steps x workers): checkpoints at equal compute."""


@dataclass
class FedResult:
    weights: StateDict
    lora: dict[str, Any]
    track_losses: list[dict[str, float]] = field(default_factory=list)
    """Per round: loss with and without the end-of-answer token on ``FedJob.track``."""
    bytes_sent: int = 0
    bytes_raw: int = 0
    relative_error: list[float] = field(default_factory=list)
    cosine: list[float] = field(default_factory=list)
    updates: int = 0
    snapshots: dict[int, StateDict] = field(default_factory=dict)
    """Weights after a number of optimiser steps: run_central after each step count asked for (e.g. the
    federated run's wall time); run_fed every ``FedJob.snapshot_every`` rounds, keyed by all workers' steps."""


def run_fed(lab: Lab, job: FedJob, on_round: Callable[[int], None] | None = None) -> FedResult:
    """Run ``job``; the expert's final weights and what the rounds sent."""
    trainers = [lab.trainer(shard, job.seed + i, lr=job.lr) for i, shard in enumerate(job.shards)]
    fresh = [copy.deepcopy(trainer.optimizer_state()) for trainer in trainers]  # no moments yet
    weights = trainers[0].adapter_state()  # the expert's initial adapter (B = 0): every worker pulls it
    manifest = manifest_of(weights)
    encoders = [UpdateEncoder(job.compression) for _ in trainers]
    combine = _combiner(job.aggregation, job.robust)
    result = FedResult(weights, trainers[0].lora_config)
    for round_index in range(job.rounds):
        updates = []
        for i, (trainer, encoder) in enumerate(zip(trainers, encoders)):
            carried = encoder.carried()
            start = {k: weights[k] + carried[k] for k in weights} if carried else weights
            trainer.load_adapter_state(start)
            if job.fresh_optimizer:
                trainer.load_optimizer_state(copy.deepcopy(fresh[i]))
            lab.train(trainer, job.steps)
            after = trainer.adapter_state()
            delta = {k: after[k] - start[k] for k in start}
            encoded = encoder.encode(delta, manifest, seed=_update_seed(job, round_index, i))
            _account(result, encoded.metrics)
            samples = job.steps * lab.batch_size
            updates.append(Update(encoded.sent, samples, i if job.aggregation == "fedasync" else 0))
            if i == 0 and job.attack is not None:  # the attacker knows an honest update and twists it
                updates.append(Update(ATTACKS[job.attack](encoded.sent), samples, 0))
        weights = combine({k: v.clone() for k, v in weights.items()}, updates,
                          AggregationParams(server_lr=job.server_lr))
        result.weights = weights
        if job.track:
            result.track_losses.append(loss_pair(lab.losses(job.track, weights, result.lora)))
        if job.snapshot_every and (round_index + 1) % job.snapshot_every == 0:
            result.snapshots[(round_index + 1) * job.steps * len(trainers)] = weights
        if on_round:
            on_round(round_index + 1)
    return result


def _combiner(aggregation: str, robust: str) -> Callable[[StateDict, list[Update], AggregationParams], StateDict]:
    return AGGREGATORS[aggregation] if robust == "none" else robust_aggregator(robust)


def _update_seed(job: FedJob, round_index: int, worker: int) -> int:
    """A distinct codec seed per update (the worker sends one with each), shifted by the run's codec seed."""
    return job.codec_seed * 1_000_003 + round_index * 101 + worker


def _account(result: FedResult, metrics: dict[str, Any]) -> None:
    result.bytes_sent += metrics["bytes_sent"]
    result.bytes_raw += metrics["bytes_raw"]
    result.relative_error.append(metrics["relative_error"])
    result.cosine.append(metrics["cosine"])
    result.updates += 1


def run_central(lab: Lab, examples: Sequence[Example], steps: int, seed: int,
                track: Sequence[Example] = (), every: int = 0, snapshots: Sequence[int] = (),
                lr: float | None = None) -> FedResult:
    """One worker on all the data for ``steps`` steps (the federated run's total compute).

    ``every``: take the tracked loss every that many steps; ``snapshots``: keep the weights after
    those step counts (<= ``steps``), e.g. after as many steps as one federated worker takes (the
    same wall time when the federated workers train in parallel and the network is free); ``lr``: the
    AdamW learning rate (None: the preset's recommended one).
    """
    trainer = lab.trainer(examples, seed, lr=lr)
    result = FedResult(trainer.adapter_state(), trainer.lora_config)
    stops = sorted({*(range(every, steps, every) if every else ()), *(n for n in snapshots if 0 < n < steps), steps})
    done = 0
    for stop in stops:
        lab.train(trainer, stop - done)
        done = stop
        if done in snapshots:
            result.snapshots[done] = trainer.adapter_state()
        if track and every and (done % every == 0 or done == steps):
            result.track_losses.append(loss_pair(lab.losses(track, trainer.adapter_state(), result.lora)))
    result.weights = trainer.adapter_state()
    return result
