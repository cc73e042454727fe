"""Wires a worker together: base model, data, trainer, client, federated loop."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from protocol.profiles import profile_to_json, text_profile
from protocol.client import CoordinatorClient
from protocol.credentials import TOKEN_ENV
from protocol.tensors import StateDict
from worker.console import SyncConsole
from worker.distributed import SingleProcess, process_group
from worker.early_stopping import BestVersion, EarlyStoppingSettings
from worker.embedded_relay import EmbeddedRelay, RelaySettings
from worker.encoding import CompressionSettings, PullSettings, UpdateEncoder
from worker.federation import FederatedWorker, SyncSettings
from worker.memory import release_freed_memory
from models.loading import load_base_model
from worker.placement import PlacementFollower
from worker.profiling import ProfileSettings, StepProfiler
from worker.splits import DataSettings, data_fingerprint, training_data
from worker.step_metrics import StepLog
from worker.strategies import ParallelSettings
from worker.threads import apply_thread_budget
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

if TYPE_CHECKING:
    from worker.dp_sgd import DPSGDSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    coordinator_url: str
    dataset: Path
    base_model: str
    sync: SyncSettings
    lora: LoraSettings
    train: TrainSettings
    use_huggingface: bool = False
    use_proxy: bool = False
    device: str = "auto"
    """auto (cuda > mps > cpu), cpu, cuda[:N] or mps; under torchrun each rank takes cuda:<local rank>."""
    compression: CompressionSettings = CompressionSettings()
    pull: PullSettings | None = None
    """None: the pulls that go with --compression (worker.encoding.default_pull)."""
    token: str | None = None
    """Join (or admin) token; None = FEDMOE_TOKEN or the local coordinator's (protocol.credentials)."""
    ca_cert: Path | None = None
    """PEM file to trust for an https coordinator with a private certificate."""
    progress: bool | None = None
    """Progress bar per sync interval: None draws it only when stderr is a terminal."""
    parallel: ParallelSettings = ParallelSettings()
    """How torchrun ranks split the model (--strategy, --cpu-offload) and compress their all-reduce."""
    profile: ProfileSettings | None = None
    """--profile DIR --profile-steps N: every rank profiles N steps and writes its trace there."""
    tensorboard: Path | None = None
    """--tensorboard DIR: rank 0 writes per-step and per-sync scalars there."""
    threads: int | None = None
    """CPU threads torch may use in this process (each rank under torchrun); None = all cores."""
    heldout_eval: bool = True
    """Log the held-out loss before and after training (two forward passes over the held-out examples)."""
    data: DataSettings = DataSettings()
    """--dataset-format, --split-key, --eval-dataset: how --dataset is read and what is held out."""
    early_stopping: EarlyStoppingSettings | None = None
    """Score every pulled expert version on the held-out split; stop when it stops improving (None: off)."""
    dp_sgd: DPSGDSettings | None = None
    """--dp-sgd: train with example-level DP-SGD (worker.dp_sgd) instead of plain AdamW steps."""
    placement: PlacementSettings | None = None
    """--follow-placement / --can-relay: sync where the root assigns (None: where --coordinator-url says)."""


@dataclass(frozen=True)
class PlacementSettings:
    interval: float = 30.0
    """Seconds between two rounds of probes and reports."""
    can_relay: bool = False
    """Run a relay (worker.embedded_relay) the root may assign workers to."""
    relay_host: str | None = None
    relay_join_token_file: Path | None = None
    relay_id: str = ""
    relay_flags: tuple[str, ...] = ()
    """More run_coordinator.py flags for the relay."""


def build_worker(config: WorkerConfig, collective: SingleProcess | None = None,
                 device: str = "cpu") -> tuple[FederatedWorker, LoraTrainer, list]:
    """Load everything a worker needs on `device`; returns (worker, trainer, held-out examples)."""
    collective = collective or SingleProcess()
    train_examples, heldout = training_data(config.dataset, config.data)
    base = load_base_model(config.base_model, use_huggingface=config.use_huggingface,
                           device=device, use_proxy=config.use_proxy)
    collective.check_same("the base model fingerprint", base.fingerprint)
    board = _tensorboard(config, collective)
    trainer = _trainer(config, base, train_examples, collective, device, board)
    if config.profile is not None:
        trainer.profiler = StepProfiler(config.profile, collective.rank)
    spec = {**trainer.expert_config, "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
    client = CoordinatorClient(config.coordinator_url, use_proxy=config.use_proxy, token=config.token,
                                ca_cert=config.ca_cert)
    log.info("%s: %d training and %d held-out examples from %s; base model %s (%s)",
             config.sync.worker_id, len(train_examples), len(heldout), config.dataset, base.model_id,
             base.fingerprint[:12])
    profile = profile_to_json(text_profile(e.prompt or e.reference_code for e in train_examples), len(train_examples))
    sync = config.sync
    if collective.world_size > 1 and (sync.overlap or sync.state_dir is not None):
        # Collectives must run in the same order on every rank, on the training thread, and a checkpoint
        # would need every rank's optimizer state: data-parallel workers sync in the loop and do not resume.
        if collective.is_primary:
            log.warning("data parallel (%d processes): syncs wait for the network and no checkpoint is kept "
                        "(--no-overlap, no --state-dir)", collective.world_size)
        sync = replace(sync, overlap=False, state_dir=None)
    placement = early_stopping = heldout_score = None
    if config.placement is not None and collective.is_primary:
        placement = PlacementFollower(
            CoordinatorClient(config.coordinator_url, use_proxy=config.use_proxy, token=config.token,
                              ca_cert=config.ca_cert), client, config.sync.worker_id, config.placement.interval)
    if config.early_stopping is not None and collective.is_primary:
        if not heldout:
            raise ValueError("--early-stopping-patience needs held-out examples; the dataset is too small to hold "
                             "any out")
        early_stopping, heldout_score = BestVersion(config.early_stopping), heldout_scorer(trainer, heldout)
    worker = FederatedWorker(sync, client, trainer, spec, encoder=UpdateEncoder(config.compression),
                             pull=config.pull, profile=profile, collective=collective,
                             console=SyncConsole(config.sync.sync_interval, progress=config.progress)
                             if collective.is_primary else None, on_result=board.sync if board else None,
                             dataset={"path": str(config.dataset), "sha256": _fingerprint(config, train_examples)},
                             placement=placement, early_stopping=early_stopping, heldout_score=heldout_score)
    return worker, trainer, heldout


def _trainer(config: WorkerConfig, base, train_examples: list, collective: SingleProcess, device: str,
             board) -> LoraTrainer:
    if config.dp_sgd is None:
        return LoraTrainer(base, config.lora, config.train, train_examples, device=device, collective=collective,
                           parallel=config.parallel, step_log=_step_sinks(config, collective, board))
    from worker.dp_sgd import DPSGDTrainer, check_dp_sgd_settings  # imports Opacus: only when asked for

    check_dp_sgd_settings(config.lora, config.train, collective.world_size)
    log.info("DP-SGD: noise multiplier %g, per-example clip %g, delta %g", config.dp_sgd.noise_multiplier,
             config.dp_sgd.max_grad_norm, config.dp_sgd.delta)
    return DPSGDTrainer(base, config.lora, config.train, train_examples, config.dp_sgd, device=device)


def _fingerprint(config: WorkerConfig, train_examples: list) -> str:
    packed = any(example.plain_text for example in train_examples)
    return data_fingerprint(config.dataset, config.data, packed=packed, max_seq_len=config.train.max_seq_len)


def heldout_scorer(trainer: LoraTrainer, heldout: list) -> Callable[[StateDict], float]:
    """Held-out loss of given adapter weights; the trainer's own weights are put back after."""
    def score(weights: StateDict) -> float:
        local = trainer.adapter_state()
        trainer.load_adapter_state(weights)
        try:
            return trainer.eval_loss(heldout)
        finally:
            trainer.load_adapter_state(local)

    return score


def _tensorboard(config: WorkerConfig, collective: SingleProcess):
    """Rank 0's TensorBoard writer for --tensorboard, or None."""
    if config.tensorboard is None or not collective.is_primary:
        return None
    from worker.tensorboard_log import TensorBoardLog  # imports tensorboard: only when asked for

    return TensorBoardLog(config.tensorboard)


def _step_sinks(config: WorkerConfig, collective: SingleProcess, board) -> Callable[[dict], None] | None:
    """Where rank 0's per-step records go: --results (for data-parallel or compressed-collective runs)
    and --tensorboard."""
    if not collective.is_primary:
        return None
    sinks: list[Callable[[dict], None]] = [board.step] if board is not None else []
    path = config.sync.results_path
    if path is not None and (collective.world_size > 1 or config.parallel.comm_compress):
        sinks.append(StepLog(path))
    if not sinks:
        return None

    def to_every_sink(record: dict) -> None:
        for sink in sinks:
            sink(record)

    return to_every_sink


def run_worker(config: WorkerConfig) -> None:
    """Train and sync until done; under torchrun, every rank runs this and rank 0 does the talking."""
    apply_thread_budget(config.threads)
    release_freed_memory()  # before the first step: freed activations go back to the OS (worker.memory)
    with process_group(config.device) as (collective, device):
        if not collective.is_primary:  # the other ranks log warnings and errors only
            logging.getLogger("worker").setLevel(logging.WARNING)
            logging.getLogger("protocol").setLevel(logging.WARNING)
        relay = start_relay(config) if collective.is_primary else None
        try:
            _train(config, collective, device)
        finally:
            if relay is not None:
                relay.stop()


def start_relay(config: WorkerConfig) -> EmbeddedRelay | None:
    """--can-relay: the worker's own relay, launched before the worker loads its model; it registers at the root when
    up, and the root's plan sends workers to it from then on (None: not asked, or it could not start: logged, and the
    worker trains on without it)."""
    placement = config.placement
    if placement is None or not placement.can_relay:
        return None
    state = config.sync.state_dir or Path("worker-state") / config.sync.worker_id
    relay = EmbeddedRelay(RelaySettings(upstream=config.coordinator_url.rstrip("/"), relay_id=placement.relay_id,
                                        data_dir=state / "relay", host=placement.relay_host,
                                        join_token=config.token or resolve_join_token(),
                                        relay_join_token_file=placement.relay_join_token_file,
                                        extra=placement.relay_flags))
    try:
        relay.launch()
    except OSError as exc:
        log.error("--can-relay: the embedded relay could not start (%s); training on without a relay", exc)
        return None
    log.info("--can-relay: relay %s starting at %s (log: %s)", placement.relay_id, relay.url, relay.log_path)
    return relay


def resolve_join_token() -> str | None:
    return os.environ.get("FEDMOE_JOIN_TOKEN") or os.environ.get(TOKEN_ENV)


def _train(config: WorkerConfig, collective: SingleProcess, device: str) -> None:
    worker, trainer, heldout = build_worker(config, collective, device)
    worker.joining.join()
    # The others need not evaluate (they wait for rank 0 in worker.run()), unless the model is sharded:
    # then every forward is a collective and all ranks evaluate together.
    if not collective.is_primary and not trainer.sharded:
        worker.run()
        return
    before = trainer.eval_loss(heldout) if config.heldout_eval and heldout else None
    if before is not None:
        log.info("held-out loss at start: %.4f", before)
    summary = worker.run()
    # CPU seconds next to wall seconds: on a shared machine they tell what the run would take alone.
    log.info("trained %d steps, %d tokens in %.1f s (%.1f CPU s)", summary.steps, summary.tokens,
             summary.seconds, summary.cpu_seconds)
    if before is not None:
        log.info("held-out loss at end: %.4f (start %.4f); %d sync(s)", trainer.eval_loss(heldout), before,
                 worker.syncs)

