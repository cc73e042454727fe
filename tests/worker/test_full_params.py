"""--lora-rank 0: the trainer trains and federates every weight of the model, with no adapter."""
from __future__ import annotations

import torch

from worker.data import load_examples, sample_dataset_path, split_examples
from models.loading import load_base_model
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

SETTINGS = TrainSettings(lr=1e-3, batch_size=4, max_seq_len=64, seed=0)


def full_trainer() -> LoraTrainer:
    train = split_examples(load_examples(sample_dataset_path("sql_expert")))[0]
    return LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(rank=0), SETTINGS, train)


def test_rank_zero_trains_every_weight_of_the_model():
    trainer = full_trainer()
    assert not hasattr(trainer.model, "peft_config")  # no adapter attached
    names = [n for n, _ in trainer.model.named_parameters()]
    before = trainer.adapter_state()
    assert sorted(before) == sorted(names) and all(t.dtype == torch.float32 for t in before.values())
    trainer.train_steps(1)
    after = trainer.adapter_state()
    unchanged = [n for n in names if torch.equal(before[n], after[n])]
    assert unchanged == []  # embeddings, norms, projections and biases all moved


def test_expert_config_is_full_with_the_exact_parameter_count():
    trainer = full_trainer()
    total = sum(p.numel() for p in trainer.model.parameters())
    assert trainer.expert_config == {"kind": "full", "full": {"num_parameters": total}}
    assert sum(t.numel() for t in trainer.adapter_state().values()) == total


def test_loading_pulled_weights_replaces_the_model_weights():
    trainer = full_trainer()
    state = {k: torch.full_like(v, 0.01) for k, v in trainer.adapter_state().items()}
    trainer.load_adapter_state(state)
    assert all(torch.equal(p, state[n]) for n, p in trainer.model.named_parameters())
