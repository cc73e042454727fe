"""Wires a worker together: base model, data, trainer, client, federated loop."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from gateway.router import profile_to_json, text_profile
from protocol.client import CoordinatorClient
from worker.console import SyncConsole
from worker.data import load_examples, split_examples
from worker.encoding import CompressionSettings, PullSettings, UpdateEncoder
from worker.federation import FederatedWorker, SyncSettings
from worker.models import load_base_model
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
    device: str = "cpu"
    compression: CompressionSettings = CompressionSettings()
    pull: PullSettings = PullSettings()
    token: str | None = None
    """Join (or admin) token; None = FEDMOE_TOKEN or the local coordinator's (protocol.credentials)."""
    ca_cert: Path | None = None
    """PEM file to trust for an https coordinator with a private certificate."""
    progress: bool | None = None
    """Progress bar per sync interval: None draws it only when stderr is a terminal."""


def build_worker(config: WorkerConfig) -> tuple[FederatedWorker, LoraTrainer, list]:
    """Load everything a worker needs; returns (worker, trainer, held-out examples)."""
    train_examples, heldout = split_examples(load_examples(config.dataset))
    base = load_base_model(config.base_model, use_huggingface=config.use_huggingface,
                           device=config.device, use_proxy=config.use_proxy)
    trainer = LoraTrainer(base, config.lora, config.train, train_examples, device=config.device)
    spec = {"lora": trainer.lora_config, "base_model": {"id": base.model_id, "fingerprint": base.fingerprint}}
    client = CoordinatorClient(config.coordinator_url, use_proxy=config.use_proxy, token=config.token,
                               ca_cert=config.ca_cert)
    log.info("%s: %d training and %d held-out examples from %s; base model %s (%s)",
             config.sync.worker_id, len(train_examples), len(heldout), config.dataset, base.model_id,
             base.fingerprint[:12])
    profile = profile_to_json(text_profile(e.prompt for e in train_examples), len(train_examples))
    worker = FederatedWorker(config.sync, client, trainer, spec, encoder=UpdateEncoder(config.compression),
                             pull=config.pull, profile=profile,
                             console=SyncConsole(config.sync.sync_interval, progress=config.progress))
    return worker, trainer, heldout


def run_worker(config: WorkerConfig) -> None:
    worker, trainer, heldout = build_worker(config)
    worker.join()
    before = trainer.eval_loss(heldout)
    log.info("held-out loss at start: %.4f", before)
    worker.run()
    log.info("held-out loss at end: %.4f (start %.4f); %d sync(s)", trainer.eval_loss(heldout), before,
             worker.syncs)
