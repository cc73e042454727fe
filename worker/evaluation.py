"""Per-example answer losses of a model on held-out examples, with and without the end-of-answer token."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from worker.data import IGNORE_INDEX, Example, collate, encode_example, pad_token_id
from worker.losses import answer_cross_entropy


@dataclass(frozen=True)
class AnswerLoss:
    """Summed answer-token cross-entropy of some examples, with and without the end-of-answer token.

    A pretrained chat model that has not seen the data's format pays 7-11 nats on the token that
    ends the answer (`<|im_end|>`), so early fine-tuning gains are partly the model learning to stop;
    the loss without that token shows what it learnt about the answers themselves.
    """

    nll: float
    """Sum of -log p over every answer token, the end-of-answer token included."""
    tokens: int
    """Number of those tokens."""
    nll_without_end: float
    """The same sum without the end-of-answer token."""
    tokens_without_end: int

    def __add__(self, other: AnswerLoss) -> AnswerLoss:
        return AnswerLoss(self.nll + other.nll, self.tokens + other.tokens,
                          self.nll_without_end + other.nll_without_end, self.tokens_without_end + other.tokens_without_end)

    @property
    def mean(self) -> float:
        """Mean loss per answer token (what training and evaluate_loss report)."""
        return self.nll / self.tokens if self.tokens else float("nan")

    @property
    def mean_without_end(self) -> float:
        return self.nll_without_end / self.tokens_without_end if self.tokens_without_end else float("nan")


NO_LOSS = AnswerLoss(0.0, 0, 0.0, 0)


def total(losses: Sequence[AnswerLoss]) -> AnswerLoss:
    return sum(losses, NO_LOSS)


@torch.no_grad()
def answer_losses(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], *,
                  max_seq_len: int = 256, batch_size: int = 8) -> list[AnswerLoss]:
    """One AnswerLoss per example, in the order given (no grad; the model should be in eval mode).

    Examples are batched by length, so little compute goes to padding.
    """
    encoded = [encode_example(tokenizer, ex, max_seq_len) for ex in examples]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
    loss = answer_cross_entropy(model)  # the head only at answer positions, a chunk of the vocabulary at a time
    end_id = tokenizer.eos_token_id
    results: dict[int, AnswerLoss] = {}
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        batch = collate([encoded[i] for i in rows], pad_token_id(tokenizer))
        nll = loss(batch.input_ids, batch.attention_mask, batch.labels, per_token=True)
        targets = batch.labels[:, 1:]
        answer = targets != IGNORE_INDEX
        body = answer & (targets != end_id) if end_id is not None else answer
        for row, index in enumerate(rows):
            results[index] = AnswerLoss(float(nll[row][answer[row]].sum()), int(answer[row].sum()),
                                        float(nll[row][body[row]].sum()), int(body[row].sum()))
    return [results[i] for i in range(len(encoded))]
