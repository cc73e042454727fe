"""FederatedWorker's training loop without a coordinator: what --speed-factor does to the figures."""
import pytest

from protocol.client import CoordinatorClient
from worker.data import load_examples, sample_dataset_path, split_examples
from worker.federation import FederatedWorker, SyncSettings
from models.loading import load_base_model
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings


def test_speed_factor_half_sleeps_as_long_as_the_steps_took_and_tokens_per_second_counts_it():
    train, _ = split_examples(load_examples(sample_dataset_path("sql_expert")))
    trainer = LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(rank=2),
                          TrainSettings(batch_size=2, max_seq_len=32), train)
    worker = FederatedWorker(SyncSettings(specialty="sql_expert", worker_id="w", speed_factor=0.5),
                             CoordinatorClient("http://127.0.0.1:9"), trainer, {"base_model": {}})  # never called
    for _ in range(2):
        worker.train_step()
    stats = worker.interval
    assert stats.steps == 2 and stats.seconds > 0
    assert stats.throttled == pytest.approx(stats.seconds)  # 0.5: one second asleep per second of compute
    assert stats.tokens_per_second == pytest.approx(stats.tokens / (2 * stats.seconds))
    assert worker.totals.throttled == stats.throttled


def test_retune_reaches_the_sync_steps_and_refuses_what_is_read_once(tmp_path):
    train, _ = split_examples(load_examples(sample_dataset_path("sql_expert")))
    trainer = LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(rank=2),
                          TrainSettings(batch_size=2, max_seq_len=32), train)
    worker = FederatedWorker(SyncSettings(specialty="sql_expert", worker_id="w"),
                             CoordinatorClient("http://127.0.0.1:9"), trainer, {"base_model": {}})  # never called
    worker.retune(state_dir=tmp_path, overlap=False)

    assert worker.pipeline.settings.state_dir == tmp_path and worker.settings.overlap is False  # loop and parts
    assert worker.pipeline.settings is worker.settings
    with pytest.raises(ValueError, match="comm_share"):
        worker.retune(comm_share=0.1)
