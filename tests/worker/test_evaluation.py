"""worker.evaluation.answer_losses: per-example answer loss, with and without the end-of-answer token."""
import math

import pytest
import torch

from worker.data import Example, encode_example
from worker.evaluation import AnswerLoss, answer_losses, total
from models.loading import load_base_model
from worker.trainer import evaluate_loss

EXAMPLES = [Example(f"Write a function number {i} that returns {i}." + " filler" * (i * 7),
                    f"def f{i}():\n    return {i}\n" * (1 + i % 3)) for i in range(7)]


@pytest.fixture(scope="module")
def base():
    return load_base_model("tiny-qwen2")


def test_the_sum_over_examples_is_the_mean_evaluate_loss_reports(base):
    per_example = answer_losses(base.model, base.tokenizer, EXAMPLES, max_seq_len=64, batch_size=3)
    expected = evaluate_loss(base.model, base.tokenizer, EXAMPLES, max_seq_len=64, batch_size=3)
    assert total(per_example).mean == pytest.approx(expected, rel=1e-5)


def test_each_example_matches_its_own_forward_pass_whatever_it_is_batched_with(base):
    batched = answer_losses(base.model, base.tokenizer, EXAMPLES, max_seq_len=64, batch_size=4)
    alone = [answer_losses(base.model, base.tokenizer, [ex], max_seq_len=64)[0] for ex in EXAMPLES]
    for b, a in zip(batched, alone):
        assert b.tokens == a.tokens and b.tokens_without_end == a.tokens_without_end
        assert b.nll == pytest.approx(a.nll, rel=1e-4) and b.nll_without_end == pytest.approx(a.nll_without_end, rel=1e-4)


def test_without_the_end_token_exactly_one_token_per_answer_is_left_out(base):
    per_example = answer_losses(base.model, base.tokenizer, EXAMPLES, max_seq_len=512)
    for example, loss in zip(EXAMPLES, per_example):
        ids, labels = encode_example(base.tokenizer, example, 512)
        answer = sum(1 for label in labels[1:] if label != -100)
        assert loss.tokens == answer and loss.tokens_without_end == answer - 1
        # the left-out term is the end token's own loss: positive, and the rest is smaller by it
        assert 0 < loss.nll - loss.nll_without_end < loss.nll


def test_answer_loss_adds_up_and_an_empty_one_has_no_mean():
    a, b = AnswerLoss(3.0, 2, 1.0, 1), AnswerLoss(5.0, 3, 4.0, 2)
    assert total([a, b]) == AnswerLoss(8.0, 5, 5.0, 3)
    assert total([a, b]).mean == pytest.approx(1.6) and total([a, b]).mean_without_end == pytest.approx(5 / 3)
    assert math.isnan(total([]).mean)


def test_the_model_is_left_as_it_was(base):
    before = {k: v.clone() for k, v in list(base.model.state_dict().items())[:3]}
    answer_losses(base.model, base.tokenizer, EXAMPLES[:2])
    assert not base.model.training
    assert all(torch.equal(before[k], base.model.state_dict()[k]) for k in before)
