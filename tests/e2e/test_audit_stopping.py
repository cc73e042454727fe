"""Audit finding: a second SIGTERM / Ctrl-C ("send it again to stop at once", worker/stopping.py) raised
KeyboardInterrupt wherever training was, e.g. inside an optimiser step, and the run then caught it and made the
final push anyway: the half-applied step's weights went to the coordinator described as the steps before it (the
torn push worker.stopping exists to prevent) and "at once" waited for a push. Sent: two SIGTERMs inside the fifth
optimiser step. Came back: a final push of 4 counted steps carrying the fifth step's (partial) weights.
Fix: worker/federation.py (``run``: a second signal ends the run without the final push).
"""
from __future__ import annotations

import signal

import pytest

from protocol.client import CoordinatorClient
from worker.data import load_examples, sample_dataset_path, split_examples
from models.loading import load_base_model
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings


def test_a_second_signal_mid_step_stops_at_once_and_pushes_nothing(start_coordinator):
    from worker.federation import FederatedWorker, SyncSettings
    from worker.stopping import STOP, restore, stop_on_signals

    _, url = start_coordinator()
    train, _ = split_examples(load_examples(sample_dataset_path("sql_expert")))
    trainer = LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(rank=4),
                          TrainSettings(batch_size=2, max_seq_len=64), train)
    optimizer_step, steps = trainer._optimizer_step, []

    def two_signals_mid_step() -> None:
        steps.append(trainer.global_step)
        if len(steps) == 5:
            signal.raise_signal(signal.SIGTERM)  # the first: stop after this step
            signal.raise_signal(signal.SIGTERM)  # the second, before the step's optimiser has run: at once
        optimizer_step()

    trainer._optimizer_step = two_signals_mid_step
    spec = {"lora": trainer.lora_config, "base_model": {"id": trainer.base.model_id,
                                                        "fingerprint": trainer.base.fingerprint}}
    records: list[dict] = []
    worker = FederatedWorker(SyncSettings(specialty="sql_expert", worker_id="w1", duration=600, sync_interval=600),
                             CoordinatorClient(url), trainer, spec, on_result=records.append)
    worker.joining.join()
    replaced = stop_on_signals()
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.run()
    finally:
        restore(replaced)

    assert not STOP.armed and len(steps) == 5
    assert records == []  # no final push was made
    info = CoordinatorClient(url).experts.get("sql_expert")
    assert info["updates_applied"] == 0 and info["samples_seen"] == 0
