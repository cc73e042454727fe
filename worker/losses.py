"""Answer-token cross-entropy without the vocabulary projection of every position.

A causal LM's own forward projects every position onto the whole vocabulary: for smollm2-135m at
batch 8 x 256 that is 8 x 256 x 49,152 float32 logits (403 MB), kept for the backward pass with
their log-softmax and gradient, although the loss reads only the answer positions. Here the
decoder runs alone (``model.model``), the hidden states of the positions that predict an answer
token are gathered, and the LM head and cross-entropy run over them in chunks of rows.

``LinearCrossEntropy`` is the idea of Liger-Kernel's fused linear cross-entropy (Hsu et al., 2024,
arXiv:2410.10989) in plain torch: the loss is the graph's end, so the gradient of the logits,
softmax - one_hot, is known in the forward pass. Each chunk's logits are computed, turned into
their gradient in place, multiplied into the gradients of the hidden states and of the head's
weight, and freed; backward only scales those gradients. No chunk of logits outlives its loop
iteration, and nothing is recomputed.

A model whose causal-LM head is not ``lm_head(hidden)`` (logit soft-capping, scaling, a LoRA on
the head) fails ``head_is_plain_linear``'s check and keeps the reference path: its own logits from
the first answer position on (``LogitsCrossEntropy``).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F

from worker.data import IGNORE_INDEX

logger = logging.getLogger(__name__)

CHUNK_ELEMENTS = 1 << 23
"""Logits per chunk (32 MiB in float32): 170 answer positions of a 49,152-token vocabulary at a time."""


def chunk_rows(vocab_size: int) -> int:
    """Positions per chunk so that one chunk of logits holds at most CHUNK_ELEMENTS values."""
    return max(1, CHUNK_ELEMENTS // max(1, vocab_size))


class LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden[i] @ weight.T, targets[i]), its gradients computed chunk by chunk in the forward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                rows: int) -> torch.Tensor:
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], rows):
            h, t = hidden[start:start + rows], targets[start:start + rows]
            logits = (h @ weight.T).float()  # under autocast the matmul runs in its dtype, the softmax in float32
            log_norm = torch.logsumexp(logits, dim=1)
            total += (log_norm - logits.gather(1, t[:, None]).squeeze(1)).sum()
            if grad_hidden is None and grad_weight is None:
                continue
            grad = logits.sub_(log_norm[:, None]).exp_()  # softmax, in place of the logits
            grad[torch.arange(len(t), device=t.device), t] -= 1.0
            if grad_hidden is not None:
                grad_hidden[start:start + rows] = grad @ weight.float()
            if grad_weight is not None:
                grad_weight.addmm_(grad.T, h.float())
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return (None if grad_hidden is None else (grad_hidden * grad_output).to(hidden_dtype),
                None if grad_weight is None else (grad_weight * grad_output).to(weight_dtype), None, None)


@torch.no_grad()
def linear_token_nll(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position, [N] float32, one chunk of logits at a time (no gradient)."""
    rows = chunk_rows(weight.shape[0])
    parts = []
    for start in range(0, hidden.shape[0], rows):
        logits = (hidden[start:start + rows] @ weight.T).float()
        parts.append(torch.logsumexp(logits, dim=1)
                     - logits.gather(1, targets[start:start + rows, None]).squeeze(1))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def summed_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of hidden @ weight.T against targets ([N, H], [V, H], [N]); float32 scalar.

    With gradients wanted, the chunked LinearCrossEntropy; without, only the loss, chunk by chunk.
    """
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(hidden, weight, targets, chunk_rows(weight.shape[0]))
    return linear_token_nll(hidden, weight, targets).sum()


def causal_lm(model: torch.nn.Module) -> Any:
    """The transformers causal LM inside ``model``: a PEFT model's base model (LoRA layers injected), else itself."""
    base_model = getattr(model, "get_base_model", None)
    return base_model() if callable(base_model) else model


class AnswerCrossEntropy(torch.nn.Module):
    """A causal LM's next-token cross-entropy over the answer positions (labels != IGNORE_INDEX).

    ``forward(input_ids, attention_mask, labels)`` returns the summed loss (a float32 scalar), or with
    ``per_token=True`` a [batch, length - 1] float32 tensor of -log p(label) that is 0 where there is
    no label. The causal LM is a submodule, so wrapping this module (DDP, FSDP) wraps its parameters
    and the whole loss runs inside the wrapper's forward.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                per_token: bool = False) -> torch.Tensor:
        targets = labels[:, 1:]
        answer = targets != IGNORE_INDEX
        if not bool(answer.any()):
            return torch.zeros(targets.shape, dtype=torch.float32, device=targets.device) if per_token else self.zero_loss(input_ids)
        return self.answer_loss(input_ids, attention_mask, targets, answer, per_token)

    def answer_loss(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor,
                    answer: torch.Tensor, per_token: bool) -> torch.Tensor:
        raise NotImplementedError

    def zero_loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Exactly 0, yet a function of every trainable weight: a rank with no answer tokens still joins
        DDP's gradient all-reduce, with zero gradients. One position's logits, so it costs next to nothing."""
        logits = self.model(input_ids=input_ids[:1, :1], use_cache=False, logits_to_keep=1).logits
        return logits.float().sum() * 0.0


class ChunkedCrossEntropy(AnswerCrossEntropy):
    """The decoder alone, hidden states gathered at the answer positions, the head and loss in chunks."""

    def answer_loss(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor,
                    answer: torch.Tensor, per_token: bool) -> torch.Tensor:
        lm = causal_lm(self.model)
        hidden = lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        hidden = hidden[:, :-1][answer]  # position t predicts the label at t + 1
        weight = lm.get_output_embeddings().weight  # tied to the embedding or not: the same tensor the head uses
        if not per_token:
            return summed_cross_entropy(hidden, weight, targets[answer])
        nll = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
        nll[answer] = linear_token_nll(hidden, weight, targets[answer])
        return nll


class LogitsCrossEntropy(AnswerCrossEntropy):
    """The reference: the model's own logits from the first position that predicts an answer token on.

    Materialises batch x positions x vocabulary float32 logits; kept for models whose head is not a
    plain linear layer and to measure the chunked path against.
    """

    def answer_loss(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor,
                    answer: torch.Tensor, per_token: bool) -> torch.Tensor:
        start = int(answer.any(dim=0).nonzero()[0])  # logits at position start predict the label at start + 1
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                            logits_to_keep=input_ids.shape[1] - start).logits
        nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), targets[:, start:],
                              ignore_index=IGNORE_INDEX, reduction="none" if per_token else "sum")
        return F.pad(nll, (start, 0)) if per_token else nll


ANSWER_LOSSES: dict[str, Callable[[torch.nn.Module], AnswerCrossEntropy]] = {
    "chunked": ChunkedCrossEntropy,
    "logits": LogitsCrossEntropy,
}
"""How the answer-token loss is computed, by name (TrainSettings.loss_path)."""


@torch.no_grad()
def head_is_plain_linear(model: torch.nn.Module) -> bool:
    """Whether the model's logits are exactly its output layer applied to its decoder's last hidden state.

    Checked on one two-token input against the model's own forward, so architectures that cap or scale
    their logits, or a head with a LoRA or a bias, keep the reference path.
    """
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return False
    was_training = model.training
    model.eval()
    try:
        ids = torch.tensor([[0, 1]], device=head.weight.device)
        own = lm(input_ids=ids, use_cache=False).logits[0, -1].float()
        ours = (lm.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0, -1] @ head.weight.T).float()
    except (AttributeError, TypeError, ValueError, NotImplementedError):
        return False
    finally:
        model.train(was_training)
    return bool(torch.allclose(own, ours, rtol=1e-4, atol=1e-4 * float(own.abs().max())))


def answer_cross_entropy(model: torch.nn.Module, path: str = "chunked") -> AnswerCrossEntropy:
    """The AnswerCrossEntropy of ``path`` (a key of ANSWER_LOSSES) around ``model``; an AnswerCrossEntropy is returned as is.

    "chunked" falls back to "logits", with a log line, for a model whose head fails head_is_plain_linear.
    """
    if isinstance(model, AnswerCrossEntropy):
        return model
    if path not in ANSWER_LOSSES:
        raise ValueError(f"unknown loss path {path!r}; known: {', '.join(ANSWER_LOSSES)}")
    if path == "chunked" and not head_is_plain_linear(model):
        logger.info("%s's logits are not its output layer on its last hidden state; computing the loss from "
                    "its own logits (every answer position x the whole vocabulary, more memory)",
                    type(causal_lm(model)).__name__)
        path = "logits"
    return ANSWER_LOSSES[path](model)
