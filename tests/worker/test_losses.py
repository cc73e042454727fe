"""worker.losses: the chunked answer-token loss equals the full-logits one, in value and gradients, and never
holds the logits of the whole batch."""
import copy

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode

from worker import losses
from worker.data import IGNORE_INDEX, Example, collate, encode_example, pad_token_id
from worker.losses import (ChunkedCrossEntropy, LinearCrossEntropy, LogitsCrossEntropy, answer_cross_entropy,
                           head_is_plain_linear)
from models.loading import load_base_model

CHUNK = 7
"""Answer positions per chunk in these tests: a batch's answers span many chunks, the last one partial."""


@pytest.fixture(scope="module")
def base():
    return load_base_model("tiny-qwen2")


@pytest.fixture(scope="module")
def batch(base):
    """Five examples of different lengths, right-padded; every prompt position is labelled IGNORE_INDEX."""
    examples = [Example(f"Write a function number {i} that returns {i}." + " filler" * (i * 5),
                        f"def f{i}():\n    return {i}\n" * (3 + 2 * (i % 3))) for i in range(5)]
    encoded = [encode_example(base.tokenizer, ex, 128) for ex in examples]
    out = collate(encoded, pad_token_id(base.tokenizer))
    assert len({len(ids) for ids, _ in encoded}) > 1 and bool((out.labels == IGNORE_INDEX).any(dim=1).all())
    return out


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch, base):
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", CHUNK * base.model.config.vocab_size)


def lora_model(base, **config):
    settings = {"r": 4, "target_modules": ["q_proj", "v_proj", "down_proj"], "init_lora_weights": False, **config}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # B != 0 (init_lora_weights=False), so the adapter changes the logits
        return get_peft_model(copy.deepcopy(base.model), LoraConfig(**settings))


def full_model(base):
    model = copy.deepcopy(base.model)
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def loss_and_grads(loss_class, model, batch):
    model.zero_grad(set_to_none=True)
    loss = loss_class(model)(batch.input_ids, batch.attention_mask, batch.labels)
    loss.backward()
    count = int((batch.labels[:, 1:] != IGNORE_INDEX).sum())
    return float(loss.detach()) / count, {n: p.grad.clone() / count for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("make_model", [lora_model, full_model], ids=["lora", "full-parameter"])
def test_chunked_loss_and_gradients_equal_the_full_logits_ones(base, batch, make_model):
    model = make_model(base)
    reference, reference_grads = loss_and_grads(LogitsCrossEntropy, model, batch)
    chunked, chunked_grads = loss_and_grads(ChunkedCrossEntropy, model, batch)
    assert chunked == pytest.approx(reference, abs=1e-5)
    assert reference_grads.keys() == chunked_grads.keys() and reference_grads
    for name, grad in reference_grads.items():
        assert float((chunked_grads[name] - grad).abs().max()) <= 1e-5 * max(1.0, float(grad.abs().max())), name


def test_the_tied_head_gets_the_embedding_gradient(base, batch):
    model = full_model(base)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tiny-qwen2 ties them, as smollm2 does
    shared = "model.embed_tokens.weight"  # named_parameters lists the tied weight once, under this name
    grads = loss_and_grads(ChunkedCrossEntropy, model, batch)[1][shared]
    reference = loss_and_grads(LogitsCrossEntropy, model, batch)[1][shared]
    # Rows of tokens the input never looks up get gradient from the head's softmax alone.
    unused = torch.ones(model.config.vocab_size, dtype=torch.bool)
    unused[batch.input_ids.unique()] = False
    assert bool(grads[unused].abs().sum(dim=1).gt(0).all())
    assert torch.allclose(grads, reference, atol=1e-6)


def test_linear_cross_entropy_matches_torch_with_a_scaled_output_gradient():
    torch.manual_seed(0)
    hidden, weight = torch.randn(30, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (30,))
    (3.0 * F.cross_entropy(hidden @ weight.T, targets, reduction="sum")).backward()
    expected = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    loss = LinearCrossEntropy.apply(hidden, weight, targets, 4)
    (3.0 * loss).backward()
    assert float(loss.detach()) == pytest.approx(float(F.cross_entropy(hidden @ weight.T, targets, reduction="sum")), rel=1e-6)
    assert torch.allclose(hidden.grad, expected[0], atol=1e-5) and torch.allclose(weight.grad, expected[1], atol=1e-5)


def test_per_token_losses_are_the_cross_entropy_at_answer_positions_and_zero_elsewhere(base, batch):
    model = lora_model(base)
    with torch.no_grad():
        chunked = ChunkedCrossEntropy(model)(batch.input_ids, batch.attention_mask, batch.labels, per_token=True)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    expected = F.cross_entropy(logits.transpose(1, 2), batch.labels[:, 1:], ignore_index=IGNORE_INDEX,
                               reduction="none")
    assert chunked.shape == expected.shape
    assert torch.allclose(chunked, expected, atol=1e-5)
    assert bool((chunked[batch.labels[:, 1:] == IGNORE_INDEX] == 0).all())


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any new tensor an op returns (views of its inputs aside)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in (*args, *(kwargs or {}).values())
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("loss_class, holds_logits", [(ChunkedCrossEntropy, False), (LogitsCrossEntropy, True)])
def test_only_the_reference_materialises_logits_for_the_whole_batch(base, batch, loss_class, holds_logits):
    model = lora_model(base)
    vocab = model.config.vocab_size
    answers = int((batch.labels[:, 1:] != IGNORE_INDEX).sum())
    with LargestTensor() as largest:
        loss_class(model)(batch.input_ids, batch.attention_mask, batch.labels).backward()
    if holds_logits:
        assert largest.numel >= answers * vocab  # the batch's answer logits, or more
    else:  # the largest tensor is an activation (batch x length x MLP width), far from the answers' logits
        assert largest.numel < answers * vocab / 2


def test_a_batch_without_answers_gives_an_exact_zero_that_reaches_every_trainable_weight(base, batch):
    model = lora_model(base)
    labels = torch.full_like(batch.labels, IGNORE_INDEX)
    loss = ChunkedCrossEntropy(model)(batch.input_ids, batch.attention_mask, labels)
    loss.backward()
    assert float(loss) == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters() if p.requires_grad)


def test_a_head_that_is_not_a_plain_linear_layer_keeps_the_reference_path(base, batch):
    plain = lora_model(base)
    with_head_lora = lora_model(base, target_modules=["q_proj", "lm_head"])
    assert head_is_plain_linear(plain) and isinstance(answer_cross_entropy(plain), ChunkedCrossEntropy)
    assert not head_is_plain_linear(with_head_lora)
    assert isinstance(answer_cross_entropy(with_head_lora), LogitsCrossEntropy)


def test_a_model_whose_logits_are_scaled_keeps_the_reference_path(base):
    scaled = copy.deepcopy(base.model)
    forward = scaled.forward

    def scaled_forward(*args, **kwargs):  # as models with logit_scale or soft-capping do
        out = forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    scaled.forward = scaled_forward
    assert not head_is_plain_linear(scaled)
    assert isinstance(answer_cross_entropy(scaled), LogitsCrossEntropy)
    with pytest.raises(ValueError, match="unknown loss path 'nope'; known: chunked, logits"):
        answer_cross_entropy(base.model, "nope")
