"""worker.dp_sgd on tiny-qwen2: Opacus's per-example gradients through PEFT's LoRA layers are the real ones,
each step is clipped per example, and the epsilon spent is the accountant's for the steps taken."""
from __future__ import annotations

import pytest
import torch

from privacy.accountant import GaussianSteps, PrivacyError, epsilon_spent
from worker.checkpoint import clone_optimizer_state
from worker.data import collate, encode_example, load_examples, pad_token_id, sample_dataset_path
from worker.dp_sgd import DPSGDSettings, DPSGDTrainer, check_dp_sgd_settings, per_example_loss
from models.loading import load_base_model
from worker.memory import want_checkpointing
from worker.trainer import LoraSettings, TrainSettings

LORA = LoraSettings(rank=4, alpha=8.0)
TRAIN = TrainSettings(lr=1e-2, batch_size=4, max_seq_len=48, seed=0)


@pytest.fixture(scope="module")
def examples():
    return load_examples(sample_dataset_path("sql_expert"))[:16]


def trainer_for(examples, sigma=1.0, clip=1.0):
    return DPSGDTrainer(load_base_model("tiny-qwen2"), LORA, TRAIN, examples, DPSGDSettings(sigma, clip))


def batch_of(trainer, examples):
    tokenizer = trainer.base.tokenizer
    return collate([encode_example(tokenizer, ex, TRAIN.max_seq_len) for ex in examples], pad_token_id(tokenizer))


def lora_gradients(trainer):
    return torch.cat([p.grad.flatten() for p in trainer._params])


@pytest.mark.slow
def test_per_example_gradients_equal_each_examples_own_gradient(examples):
    trainer = trainer_for(examples)
    # B starts at zero, which makes A's gradient zero: move B so that every LoRA factor has a gradient
    with torch.no_grad():
        for p in trainer._params:
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    trainer.model.train()
    three = examples[:3]
    per_example_loss(trainer._train_model, batch_of(trainer, three)).mean().backward()
    batched = [p.grad_sample.clone() for p in trainer._params]
    for i, example in enumerate(three):
        for p in trainer._params:
            p.grad = None
            p.grad_sample = None
        per_example_loss(trainer.model, batch_of(trainer, [example])).sum().backward()
        for p, samples in zip(trainer._params, batched):
            assert torch.allclose(samples[i], p.grad, atol=1e-6, rtol=1e-4)
        assert any(p.grad.abs().sum() > 0 for p in trainer._params)


@pytest.mark.slow
def test_a_step_is_clipped_per_example(examples):
    clip = 1e-3
    trainer = trainer_for(examples, sigma=1e-9, clip=clip)  # noise too small to matter: only clipping shows
    trainer.model.train()
    trainer._dp_step(batch_of(trainer, examples[:3]))
    norm = float(lora_gradients(trainer).norm())
    # three clipped gradients summed, over the expected batch size (4): at most 3C/4, and here every example's
    # gradient is far above C, so each is clipped to exactly C and the sum is near it
    assert 0.5 * clip / TRAIN.batch_size < norm <= 3 * clip / TRAIN.batch_size * (1 + 1e-4)


@pytest.mark.slow
def test_epsilon_spent_is_the_accountants_for_the_steps_taken_and_the_adapter_learns(examples):
    trainer = trainer_for(examples, sigma=0.8, clip=1.0)
    before = trainer.adapter_state()
    stats = trainer.train_steps(3)
    spent = trainer.privacy_spent()
    assert trainer.sample_rate == pytest.approx(4 / 16)
    assert spent["steps"] == stats.steps == 3
    assert spent["epsilon"] == pytest.approx(epsilon_spent([GaussianSteps(0.8, 0.25, 3)], 1e-5), abs=1e-6)
    assert spent["epsilon"] > 0 and spent["delta"] == 1e-5
    after = trainer.adapter_state()
    assert any(not torch.equal(before[k], after[k]) for k in before if "lora_B" in k)
    assert all(torch.isfinite(v).all() for v in after.values())
    # a checkpoint carries the ledger: a resumed worker goes on counting from 3 steps, not from 0
    saved = clone_optimizer_state(trainer.optimizer_state())
    resumed = trainer_for(examples, sigma=0.8, clip=1.0)
    resumed.load_optimizer_state(saved)
    assert resumed.privacy_spent()["steps"] == 3 and resumed.privacy_spent()["epsilon"] == spent["epsilon"]


def test_dp_sgd_flag_parses_and_names_itself_when_wrong():
    assert DPSGDSettings.parse("1.1,0.5") == DPSGDSettings(1.1, 0.5)
    for bad in ("1.0", "a,b", "1,2,3", "0,1", "1,-1"):
        with pytest.raises(PrivacyError, match="--dp-sgd"):
            DPSGDSettings.parse(bad)


@pytest.mark.parametrize("lora, train, match", [
    (LoraSettings(rank=0), TRAIN, "--lora-rank 0"),
    (LORA, TrainSettings(batch_size=4, grad_accum=2), "--grad-accum"),
    (LORA, TrainSettings(precision="bf16"), "--precision"),
    (LORA, TrainSettings(gradient_checkpointing=True), "--gradient-checkpointing"),
])
def test_settings_dp_sgd_cannot_honour_are_refused(lora, train, match):
    with pytest.raises(PrivacyError, match=match):
        check_dp_sgd_settings(lora, train)


def test_a_batch_large_enough_for_auto_checkpointing_trains_without_it(examples):
    """--gradient-checkpointing auto turns checkpointing on for large micro-batches (smollm2 at 4 x 128); Opacus's
    per-example hooks then found no gradient sample and the first DP-SGD step raised (bench.privacy on smollm2).
    Under DP-SGD auto means off."""
    train = TrainSettings(lr=1e-2, batch_size=16, max_seq_len=16384, seed=0)
    base = load_base_model("tiny-qwen2")
    assert want_checkpointing(None, base.model.config, train.batch_size, train.max_seq_len)  # auto would checkpoint
    trainer = DPSGDTrainer(base, LORA, train, examples, DPSGDSettings(1.0, 1.0))
    assert trainer.checkpointing is False
    stats = trainer.train_steps(1)
    assert stats.steps == 1 and trainer.privacy.epsilon() > 0
