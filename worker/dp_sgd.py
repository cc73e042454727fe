"""Example-level DP-SGD inside a worker (Abadi et al., CCS 2016, "Deep Learning with Differential
Privacy"), with Opacus, on the LoRA parameters only (``--dp-sgd noise_multiplier,max_grad_norm``).

Each optimiser step, as the analysis assumes:
1. a Poisson-sampled batch: every training example joins independently with probability
   q = batch_size / examples (Opacus's ``UniformWithReplacementSampler``), so batch sizes vary and
   a batch may be empty (then the step is noise only);
2. every example's gradient of its own mean answer-token loss (Opacus's ``GradSampleModule``),
   clipped to L2 norm ``max_grad_norm`` over all LoRA parameters together;
3. their sum plus N(0, (noise_multiplier x max_grad_norm)^2), divided by the expected batch size,
   handed to AdamW (Opacus's ``DPOptimizer``). AdamW only post-processes the private gradient.

The epsilon spent is accounted by ``privacy.accountant`` (Opacus's RDP accountant, sample rate q) at
``delta``. The sampling and the noise draw from the operating system's entropy, never from --seed:
an observer who knows the seed could replay the batches (no amplification) and subtract the noise.
Only a single process in fp32 is supported (no --grad-accum, data parallelism, autocast or gradient
checkpointing: each would change what one example's gradient is).
"""
from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from opacus.utils.uniform_sampler import UniformWithReplacementSampler

from privacy.accountant import DEFAULT_ACCOUNTANT, PrivacyError, PrivacyLedger, check_delta
from privacy.dp import noise_generator
from worker.data import IGNORE_INDEX, Batch, Example, collate, encode_example, pad_token_id
from models.loading import BaseModel
from worker.strategies import ParallelSettings
from worker.trainer import LoraSettings, LoraTrainer, StepStats, TrainSettings


LEDGER_KEY = "dp_sgd_privacy"
"""Where optimizer_state() keeps the ledger (JSON) inside the first parameter group."""


@dataclass(frozen=True)
class DPSGDSettings:
    """``--dp-sgd noise_multiplier,max_grad_norm`` (and ``--dp-delta``)."""

    noise_multiplier: float
    """sigma: the noise on each step's summed gradient has std sigma x max_grad_norm."""
    max_grad_norm: float
    """C: every example's gradient is clipped to this L2 norm (all LoRA parameters together)."""
    delta: float = 1e-5
    """The delta of the (epsilon, delta) reported; keep it well below 1 / training examples."""
    accountant: str = DEFAULT_ACCOUNTANT

    def __post_init__(self) -> None:
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0):
            raise PrivacyError(f"--dp-sgd noise multiplier must be positive, got {self.noise_multiplier!r}")
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise PrivacyError(f"--dp-sgd max grad norm must be positive, got {self.max_grad_norm!r}")
        check_delta(self.delta)

    @classmethod
    def parse(cls, text: str, delta: float = 1e-5) -> DPSGDSettings:
        """From the flag's "noise_multiplier,max_grad_norm", e.g. "1.0,1.0"."""
        parts = text.split(",")
        try:
            sigma, clip = (float(p) for p in parts)
        except ValueError:
            raise PrivacyError(f"--dp-sgd wants NOISE_MULTIPLIER,MAX_GRAD_NORM, e.g. 1.0,1.0; got {text!r}") from None
        return cls(sigma, clip, delta)


def check_dp_sgd_settings(lora: LoraSettings, train: TrainSettings, world_size: int = 1) -> None:
    """PrivacyError naming the flag for a setting DP-SGD here cannot honour."""
    if lora.rank < 1:
        raise PrivacyError("--dp-sgd trains LoRA parameters only; it cannot be used with --lora-rank 0")
    if world_size > 1:
        raise PrivacyError("--dp-sgd runs in a single process; drop the data-parallel launch")
    if train.grad_accum != 1:
        raise PrivacyError(f"--dp-sgd needs --grad-accum 1 (got {train.grad_accum}): each step is one Poisson batch")
    if train.precision != "fp32":
        raise PrivacyError(f"--dp-sgd needs --precision fp32 (got {train.precision})")
    if train.gradient_checkpointing:
        raise PrivacyError("--dp-sgd cannot be combined with --gradient-checkpointing")


def per_example_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Each example's mean answer-token cross-entropy, shape [batch] (0 for an example with no answer token)."""
    targets = batch.labels[:, 1:]
    start = int((targets != IGNORE_INDEX).any(dim=0).nonzero()[0])  # logits at `start` predict labels at start + 1
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   logits_to_keep=batch.input_ids.shape[1] - start, use_cache=False).logits
    targets = targets[:, start:]
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), targets, ignore_index=IGNORE_INDEX,
                          reduction="none")
    counts = (targets != IGNORE_INDEX).sum(dim=1).clamp(min=1)
    return nll.sum(dim=1) / counts


class DPSGDTrainer(LoraTrainer):
    """A LoraTrainer whose steps are DP-SGD steps; ``privacy`` holds the epsilon spent so far."""

    def __init__(self, base: BaseModel, lora: LoraSettings, train: TrainSettings, train_examples: Sequence[Example],
                 dp: DPSGDSettings, device: str = "cpu") -> None:
        check_dp_sgd_settings(lora, train)
        # --gradient-checkpointing auto stays off: Opacus's per-example gradient hooks see no layer recomputed in
        # the backward pass (a smollm2 worker at 4 x 128, where auto turns it on, failed its first DP-SGD step)
        train = replace(train, gradient_checkpointing=False)
        self.dp = dp
        self.privacy = PrivacyLedger(delta=dp.delta, accountant=dp.accountant)
        super().__init__(base, lora, train, train_examples, device=device)

    def _wrap(self, parallel: ParallelSettings) -> None:
        super()._wrap(parallel)
        # Per-example gradients of the trainable (LoRA) layers, from hooks on their forward and backward.
        self._train_model = GradSampleModule(self.model, batch_first=True, loss_reduction="mean")

    def _setup_optimizer(self) -> None:
        super()._setup_optimizer()
        self._optimizer = DPOptimizer(self._optimizer, noise_multiplier=self.dp.noise_multiplier,
                                      max_grad_norm=self.dp.max_grad_norm,
                                      expected_batch_size=self.settings.batch_size, loss_reduction="mean",
                                      generator=noise_generator())

    def _setup_data(self, train_examples: Sequence[Example]) -> None:
        super()._setup_data(train_examples)  # the plain stream stays for checkpoint positions
        tokenizer, train = self.base.tokenizer, self.settings
        self._encoded = [encode_example(tokenizer, ex, train.max_seq_len) for ex in train_examples]
        self.sample_rate = min(1.0, train.batch_size / len(self._encoded))
        """q: the probability that one example is in one step's batch."""
        self._sampler = UniformWithReplacementSampler(num_samples=len(self._encoded), sample_rate=self.sample_rate,
                                                      generator=noise_generator(), steps=1)

    def _poisson_batch(self) -> Batch | None:
        """The next Poisson-sampled batch, or None when no example was drawn."""
        rows = next(iter(self._sampler))
        if not rows:
            return None
        return collate([self._encoded[i] for i in rows], pad_token_id(self.base.tokenizer)).to(self.device)

    def train_steps(self, n: int) -> StepStats:
        """n DP-SGD steps; each is booked in ``privacy`` once taken."""
        if n < 1:
            raise ValueError(f"number of steps must be at least 1, got {n}")
        self.model.train()
        started = time.perf_counter()
        losses, tokens, samples = [], 0, 0
        for _ in range(n):
            batch = self._poisson_batch()
            losses.append(self._dp_step(batch))
            self.privacy.record(self.dp.noise_multiplier, self.sample_rate)
            tokens += batch.num_tokens if batch is not None else 0
            samples += batch.num_samples if batch is not None else 0
        self.model.eval()
        counted = [loss for loss in losses if not math.isnan(loss)]
        return StepStats(loss=sum(counted) / len(counted) if counted else math.nan, tokens=tokens, samples=samples,
                         steps=n, seconds=time.perf_counter() - started)

    def _dp_step(self, batch: Batch | None) -> float:
        """One step: clipped per-example gradients plus noise; the batch's mean loss (NaN for an empty batch)."""
        self._optimizer.zero_grad(set_to_none=True)
        has_answers = batch is not None and bool((batch.labels[:, 1:] != IGNORE_INDEX).any())
        if batch is None or not has_answers:  # noise only: the mechanism still runs, over no example
            for param in self._params:
                param.grad_sample = torch.zeros((0, *param.shape), dtype=param.dtype, device=param.device)
            loss = math.nan
        else:
            per_example = per_example_loss(self._train_model, batch)
            with warnings.catch_warnings():  # Opacus's hooks on layers whose inputs need no grad: harmless
                warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
                per_example.mean().backward()
            loss = float(per_example.detach().mean())
        self._optimizer.step()
        self.global_step += 1
        return loss

    def optimizer_state(self) -> dict:
        """The optimiser's state with the privacy ledger in its first parameter group, so that a checkpoint
        carries the epsilon spent with the moments it belongs to: a resumed run goes on counting, never from 0."""
        state = super().optimizer_state()
        groups = [dict(group) for group in state["param_groups"]]
        groups[0][LEDGER_KEY] = self.privacy.to_json()
        return {**state, "param_groups": groups}

    def load_optimizer_state(self, state: dict) -> None:
        groups = [dict(group) for group in state["param_groups"]]
        saved = groups[0].pop(LEDGER_KEY, None)
        if saved is not None:
            self.privacy = PrivacyLedger.from_json(saved)
        super().load_optimizer_state({**state, "param_groups": groups})

    def privacy_spent(self) -> dict[str, Any]:
        """{"mechanism": "dp-sgd", "epsilon", "delta", "steps", "noise_multiplier", "max_grad_norm", "sample_rate",
        "accountant"}: what the worker's results and its pushed updates carry."""
        return {"mechanism": "dp-sgd", **self.privacy.report(), "noise_multiplier": self.dp.noise_multiplier,
                "max_grad_norm": self.dp.max_grad_norm, "sample_rate": self.sample_rate}
