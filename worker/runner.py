"""Wires a worker together: base model, data, trainer, client, federated loop."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from gateway.router import profile_to_json, text_profile
from protocol.client import CoordinatorClient
from worker.console import SyncConsole
from worker.data import load_examples, split_examples
from worker.distributed import SingleProcess, process_group
from worker.encoding import CompressionSettings, PullSettings, UpdateEncoder
from worker.federation import FederatedWorker, SyncSettings
from worker.models import load_base_model
from worker.threads import apply_thread_budget
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

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
    pull: PullSettings = PullSettings()
    token: str | None = None
    """Join (or admin) token; None = FEDMOE_TOKEN or the local coordinator's (protocol.credentials)."""
    ca_cert: Path | None = None
    """PEM file to trust for an https coordinator with a private certificate."""
    progress: bool | None = None
    """Progress bar per sync interval: None draws it only when stderr is a terminal."""
    threads: int | None = None
    """CPU threads torch may use in this process (each rank under torchrun); None = all cores."""
    heldout_eval: bool = True
    """Log the held-out loss before and after training (two forward passes over the held-out examples)."""


def build_worker(config: WorkerConfig, collective: SingleProcess | None = None,
                 device: str = "cpu") -> tuple[FederatedWorker, LoraTrainer, list]:
    """Load everything a worker needs on `device`; returns (worker, trainer, held-out examples)."""
    collective = collective or SingleProcess()
    train_examples, heldout = split_examples(load_examples(config.dataset))
    base = load_base_model(config.base_model, use_huggingface=config.use_huggingface,
                           device=device, use_proxy=config.use_proxy)
    collective.check_same("the base model fingerprint", base.fingerprint)
    trainer = LoraTrainer(base, config.lora, config.train, train_examples, device=device, collective=collective)
    spec = {**trainer.expert_config, "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
    client = CoordinatorClient(config.coordinator_url, use_proxy=config.use_proxy, token=config.token,
                                ca_cert=config.ca_cert)
    log.info("%s: %d training and %d held-out examples from %s; base model %s (%s)",
             config.sync.worker_id, len(train_examples), len(heldout), config.dataset, base.model_id,
             base.fingerprint[:12])
    profile = profile_to_json(text_profile(e.prompt for e in train_examples), len(train_examples))
    sync = config.sync
    if collective.world_size > 1 and (sync.overlap or sync.state_dir is not None):
        # Collectives must run in the same order on every rank, on the training thread, and a checkpoint
        # would need every rank's optimizer state: data-parallel workers sync in the loop and do not resume.
        if collective.is_primary:
            log.warning("data parallel (%d processes): syncs wait for the network and no checkpoint is kept "
                        "(--no-overlap, no --state-dir)", collective.world_size)
        sync = replace(sync, overlap=False, state_dir=None)
    worker = FederatedWorker(sync, client, trainer, spec, encoder=UpdateEncoder(config.compression),
                             pull=config.pull, profile=profile, collective=collective,
                             console=SyncConsole(config.sync.sync_interval, progress=config.progress)
                             if collective.is_primary else None)
    return worker, trainer, heldout


def run_worker(config: WorkerConfig) -> None:
    """Train and sync until done; under torchrun, every rank runs this and rank 0 does the talking."""
    apply_thread_budget(config.threads)
    with process_group(config.device) as (collective, device):
        if not collective.is_primary:  # the other ranks log warnings and errors only
            logging.getLogger("worker").setLevel(logging.WARNING)
            logging.getLogger("protocol").setLevel(logging.WARNING)
        worker, trainer, heldout = build_worker(config, collective, device)
        worker.join()
        if not collective.is_primary:  # the others need not evaluate; they wait for rank 0 in worker.run()
            worker.run()
            return
        before = trainer.eval_loss(heldout) if config.heldout_eval else None
        if before is not None:
            log.info("held-out loss at start: %.4f", before)
        summary = worker.run()
        # CPU seconds next to wall seconds: on a shared machine they tell what the run would take alone.
        log.info("trained %d steps, %d tokens in %.1f s (%.1f CPU s)", summary.steps, summary.tokens,
                 summary.seconds, summary.cpu_seconds)
        if before is not None:
            log.info("held-out loss at end: %.4f (start %.4f); %d sync(s)", trainer.eval_loss(heldout), before,
                     worker.syncs)
