"""LoRA fine-tuning of a base model on one expert's examples (PEFT LoRA, AdamW, answer-only loss)."""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from worker.data import (IGNORE_INDEX, Batch, BatchStream, Example, StreamPosition, collate, encode_examples,
                         pad_token_id)
from worker.distributed import PRECISIONS, SingleProcess, autocast, check_precision, grad_scaler
from worker.full_params import full_expert_config, trainable_weights
from worker.losses import ANSWER_LOSSES, answer_cross_entropy
from worker.memory import want_checkpointing
from models.loading import BaseModel, default_target_modules
from worker.optimizers import OptimizerSettings, build_optimizer
from worker.sharded_state import broadcast_into, gather_full, load_full
from worker.step_metrics import peak_memory_mb
from worker.strategies import ParallelSettings, choose_strategy, make_strategy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 8
    """LoRA rank r: inner dimension of B @ A; 0 trains every weight instead (a full-parameter expert)."""
    alpha: float = 16.0
    """LoRA alpha; the update is scaled by alpha / rank."""
    target_modules: tuple[str, ...] = ()
    """Module names to adapt; empty means every Qwen/Llama projection the model has."""
    dropout: float = 0.0
    """Dropout on the LoRA input during training."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"LoRA rank must be at least 1 (or 0 for a full-parameter expert), got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))


@dataclass(frozen=True)
class TrainSettings:
    lr: float = 2e-4
    """AdamW learning rate: 2e-4 suits pretrained models; the random-init tiny-qwen2 preset learns best near 1e-2."""
    batch_size: int = 8
    """Examples per optimiser step."""
    max_seq_len: int = 256
    """Longest tokenised example; longer ones are truncated (see worker.data.encode_example)."""
    seed: int = 0
    """Seeds the LoRA A initialisation, the data order and dropout."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm of the LoRA parameters to this value."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay on the LoRA parameters."""
    grad_accum: int = 1
    """Micro-batches per optimiser step: each step's batch is split in this many forward/backward passes."""
    precision: str = "fp32"
    """fp32, or bf16/fp16 autocast for the forward pass (weights and optimiser stay float32)."""
    gradient_checkpointing: bool | None = None
    """Recompute each decoder layer's activations in the backward pass (less memory, more compute); None:
    only when the activations of a micro-batch would be large (worker.memory.want_checkpointing)."""
    loss_path: str = "chunked"
    """How the answer-token loss is computed (worker.losses): chunked (the head only at answer positions, a
    chunk of the vocabulary at a time) or logits (the model's own logits of every position after the prompt)."""
    optimizer: OptimizerSettings = OptimizerSettings()
    """--optimizer adamw, or galore (low-rank projected Adam for full-parameter experts) and its settings."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"learning rate must be positive, got {self.lr!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size!r}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be at least 2, got {self.max_seq_len!r}")
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {self.max_grad_norm!r}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be non-negative, got {self.weight_decay!r}")
        if self.grad_accum < 1:
            raise ValueError(f"--grad-accum must be at least 1, got {self.grad_accum!r}")
        if self.loss_path not in ANSWER_LOSSES:
            raise ValueError(f"loss_path must be one of {', '.join(ANSWER_LOSSES)}, got {self.loss_path!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")


@dataclass(frozen=True)
class StepStats:
    loss: float
    """Mean over the steps of each step's mean answer-token loss (NaN if no step had answer tokens)."""
    tokens: int
    """Non-padding tokens processed (prompt and answer)."""
    samples: int
    """Examples processed."""
    steps: int
    """Optimiser steps taken."""
    seconds: float
    """Wall-clock time of the steps."""

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else math.inf


def labelled_positions(batch: Batch | None) -> int:
    """How many positions of the batch have a next-token label (what the answer-token loss averages over)."""
    return 0 if batch is None else int((batch.labels[:, 1:] != IGNORE_INDEX).sum())


def select_rows(batch: Batch, rows: torch.Tensor) -> Batch | None:
    """The given rows of a right-padded batch, without the padding columns none of them needs; None if no rows."""
    if rows.numel() == 0:
        return None
    mask = batch.attention_mask[rows]
    length = int(mask.sum(dim=1).max())
    return Batch(batch.input_ids[rows, :length], mask[:, :length], batch.labels[rows, :length])


def micro_batches(batch: Batch, rank: int, world_size: int, grad_accum: int) -> list[Batch | None]:
    """This rank's share of a global batch, in grad_accum micro-batches (None where one is empty).

    The rank keeps rows rank, rank + world_size, ... as torch's DistributedSampler deals indices; as
    every rank draws the same seeded global batch, the ranks together cover it exactly once.
    """
    if world_size == 1 and grad_accum == 1:
        return [batch]
    rows = torch.arange(rank, batch.num_samples, world_size)
    return [select_rows(batch, part) for part in rows.tensor_split(grad_accum)]


@torch.no_grad()
def evaluate_loss(model: PreTrainedModel | torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                  examples: Sequence[Example], *, max_seq_len: int = 256, batch_size: int = 8,
                  device: str | torch.device = "cpu") -> float:
    """Mean cross-entropy per answer token over the examples (in order, no grad, eval mode; plain text packed).

    ``model`` is a causal LM (a PEFT model too) or the AnswerCrossEntropy a trainer wraps one in.
    """
    if not examples:
        raise ValueError("evaluate_loss needs at least one example")
    loss = answer_cross_entropy(model)
    was_training = model.training
    model.eval()
    encoded = encode_examples(tokenizer, examples, max_seq_len)
    total, count = 0.0, 0
    try:
        for i in range(0, len(encoded), batch_size):
            batch = collate(encoded[i:i + batch_size], pad_token_id(tokenizer)).to(device)
            total += float(loss(batch.input_ids, batch.attention_mask, batch.labels))
            count += labelled_positions(batch)
    finally:
        model.train(was_training)
    return total / count if count else math.nan


class LoraTrainer:
    """Trains a LoRA adapter on base.model, which it wraps in place (one trainer per BaseModel).

    With rank 0 it trains every weight of base.model instead (a full-parameter expert).

    With a data-parallel `collective` (worker.distributed), every rank draws the same global batch
    and trains on its own rows of it under the strategy of `parallel` (worker.strategies: DDP or
    FSDP2 shards); the gradient is scaled so the step equals the single-process step on the whole batch.
    With a sharding strategy rank 0 keeps a gathered copy of the adapter, refreshed after every
    `train_steps`, which is what `adapter_state` returns; the other ranks hold only their shards.
    """

    def __init__(self, base: BaseModel, lora: LoraSettings, train: TrainSettings,
                 train_examples: Sequence[Example], device: str = "cpu", collective: SingleProcess | None = None,
                 parallel: ParallelSettings | None = None,
                 step_log: Callable[[dict[str, Any]], None] | None = None):
        if not train_examples:
            raise ValueError("no training examples; check --dataset (every example may have been held out)")
        if hasattr(base.model, "peft_config"):
            raise ValueError("this base model already carries a LoRA adapter; load a fresh BaseModel per trainer")
        self.collective = collective or SingleProcess()
        if train.batch_size < self.collective.world_size * train.grad_accum:
            raise ValueError(f"--batch-size {train.batch_size} is smaller than {self.collective.world_size} "
                             f"process(es) x --grad-accum {train.grad_accum}; each step's batch is split among them")
        check_precision(train.precision, device)
        self.base = base
        self.lora = lora
        self.settings = train
        self.device = device
        self.step_log = step_log
        """Called on this rank with each step's metrics (worker.step_metrics.StepLog appends them to --results)."""
        self.profiler: Any = None
        """A worker.profiling.StepProfiler wrapping each step (--profile), or None."""
        self.global_step = 0
        self._setup_model(parallel or ParallelSettings())
        self._setup_optimizer()
        self._setup_data(train_examples)

    def _setup_model(self, parallel: ParallelSettings) -> None:
        """Attach the LoRA adapter (or unfreeze every weight for rank 0) and wrap the model for the ranks."""
        base, lora, train = self.base, self.lora, self.settings
        micro_batch = math.ceil(train.batch_size / (self.collective.world_size * train.grad_accum))
        self.checkpointing = want_checkpointing(train.gradient_checkpointing, base.model.config, micro_batch,
                                                train.max_seq_len)
        if self.checkpointing:
            # Non-reentrant checkpointing works with frozen inputs and with DDP; reentrant does neither well.
            base.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if lora.rank == 0:  # a full-parameter expert: every weight trains, no adapter (worker/full_params.py)
            self.target_modules: tuple[str, ...] = ()
            self.model = base.model.to(self.device)  # type: ignore[arg-type]  # transformers: .to's wrapper is typed (model) -> model
            self._adapter = trainable_weights(self.model)
        else:
            self.target_modules = lora.target_modules or tuple(default_target_modules(base.model))
            config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(self.target_modules),  # type: ignore[arg-type]  # peft hints int; a float alpha works (scaling = alpha / r)
                                lora_dropout=lora.dropout, init_lora_weights=True, bias="none",
                                task_type="CAUSAL_LM")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.settings.seed)  # A is drawn from the seeded CPU RNG; B starts at zero
                self.model = get_peft_model(base.model, config)
            self.model.to(self.device)
            self._adapter = get_peft_model_state_dict(self.model)  # live views of the LoRA parameters
        self._answer_loss = answer_cross_entropy(self.model, self.settings.loss_path)
        self._wrap(parallel)

    def _setup_optimizer(self) -> None:
        """The optimiser over the trainable parameters (after _wrap: FSDP replaces them) and the fp16 gradient scaler."""
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        if self.settings.optimizer.name != "adamw" and self.sharded:
            raise ValueError(f"--optimizer {self.settings.optimizer.name} needs whole weight matrices; use it with "
                             "--strategy ddp, not a sharding strategy")
        self._optimizer = build_optimizer(self.settings.optimizer, self.model, self._params, lr=self.settings.lr,
                                          weight_decay=self.settings.weight_decay)
        self._scaler = grad_scaler(self.device, self.settings.precision)

    def _setup_data(self, train_examples: Sequence[Example]) -> None:
        """Tokenise the examples once and deal them in seeded batches."""
        tokenizer, train = self.base.tokenizer, self.settings
        encoded = encode_examples(tokenizer, train_examples, train.max_seq_len)
        self._stream = BatchStream(encoded, train.batch_size, seed=train.seed, pad_id=pad_token_id(tokenizer))

    def _wrap(self, parallel: ParallelSettings) -> None:
        """Pick the strategy and wrap (or shard) the model for it; before the optimiser sees the parameters."""
        from worker.comm_hooks import CommMeter  # torch.distributed hooks, needed only with --comm-compress

        self.parallel = parallel
        num_parameters = sum(p.numel() for p in self.model.parameters())
        self.strategy = choose_strategy(parallel, num_parameters, self.collective.world_size)
        self.comm_meter = CommMeter() if parallel.comm_compress and self.strategy == "ddp" else None
        self._strategy = make_strategy(self.strategy, parallel, self.comm_meter)
        # The adapter's live views share storage with the parameters they show: that names their parameter.
        fqns = {p.data_ptr(): name for name, p in self.model.named_parameters()}
        keys = {key: fqns[p.data_ptr()] for key, p in self._adapter.items()}
        # The strategy wraps the loss around the model: DDP's and FSDP's forward then covers the whole loss.
        self._train_model = self._strategy.wrap(self._answer_loss, self.collective, self.device)
        self._gathered: dict[str, torch.Tensor] | None = None
        if self._strategy.shards:  # fully_shard swapped every parameter for a DTensor one, under the same name
            params = dict(self.model.named_parameters())
            self._adapter = {key: params[fqn] for key, fqn in keys.items()}
            self._refresh_gathered()

    @property
    def sharded(self) -> bool:
        """True when parameters are FSDP shards: forwards, evaluation and state moves are collectives."""
        return self._strategy.shards

    def _refresh_gathered(self) -> None:
        """Rank 0's full copy of the sharded adapter (every rank takes part in the gathers)."""
        self._gathered = gather_full(self._adapter, keep=self.collective.is_primary) or None

    @property
    def lora_config(self) -> dict:
        """What the coordinator needs to know about the adapter's shape and scale."""
        return {"rank": self.lora.rank, "alpha": self.lora.alpha, "target_modules": list(self.target_modules)}

    @property
    def expert_config(self) -> dict:
        """The expert spec's kind-specific part: {"kind": "lora", "lora": ...} or {"kind": "full", "full": ...}."""
        return full_expert_config(self._adapter) if self.lora.rank == 0 else {"kind": "lora", "lora": self.lora_config}

    @property
    def data_position(self) -> StreamPosition:
        """Where the training data stream stands, for checkpointing."""
        return self._stream.position

    def seek(self, position: StreamPosition) -> None:
        """Resume the training data stream from a checkpointed position."""
        self._stream.seek(position)

    def optimizer_state(self) -> dict:
        """The optimiser's state_dict, for checkpointing (its tensors are live: clone before training on)."""
        return self._optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        """Restore a checkpointed optimiser state (AdamW moments and step counts)."""
        self._optimizer.load_state_dict(state)

    def train_steps(self, n: int) -> StepStats:
        """Take n optimiser steps on the next n batches of the training stream."""
        if n < 1:
            raise ValueError(f"number of steps must be at least 1, got {n}")
        self.model.train()
        started = time.perf_counter()
        losses, tokens, samples = [], 0, 0
        for _ in range(n):
            batch = next(self._stream).to(self.device)
            step_started = time.perf_counter()
            with self.profiler.step() if self.profiler is not None else contextlib.nullcontext():
                losses.append(self._step(batch))
            if self.step_log is not None:
                self.step_log(self._step_record(batch, losses[-1], time.perf_counter() - step_started))
            tokens += batch.num_tokens
            samples += batch.num_samples
        self.model.eval()
        if self.sharded:
            self._refresh_gathered()
        seconds = time.perf_counter() - started
        counted = [loss for loss in losses if not math.isnan(loss)]
        mean_loss = sum(counted) / len(counted) if counted else math.nan
        return StepStats(loss=mean_loss, tokens=tokens, samples=samples, steps=n, seconds=seconds)

    def _step(self, batch: Batch) -> float:
        """One optimiser step on the global batch; returns its mean answer-token loss (NaN if it has none)."""
        micro = micro_batches(batch, self.collective.rank, self.collective.world_size, self.settings.grad_accum)
        counts = [labelled_positions(mb) for mb in micro]
        total = self.collective.sum(float(sum(counts)))  # answer tokens in the whole global batch
        if total == 0:  # every answer was truncated away; nothing to learn from this batch
            self.global_step += 1
            return math.nan
        self._optimizer.zero_grad(set_to_none=True)
        loss_sum = self._accumulate_gradients(batch, micro, counts, total)
        self._optimizer_step()
        return self.collective.sum(loss_sum) / total

    def _accumulate_gradients(self, batch: Batch, micro: list[Batch | None], counts: list[int], total: float) -> float:
        """Forward and backward every micro-batch, reducing gradients across ranks after the last; the loss sum."""
        # Each backward adds sum/(total/N); DDP averages over the N ranks, so the gradient is sum/total.
        per_rank = total / self.collective.world_size
        last = len(micro) - 1
        loss_sum = 0.0
        with torch.random.fork_rng(devices=[], enabled=self.lora.dropout > 0):
            if self.lora.dropout > 0:
                torch.manual_seed(self.settings.seed * 1_000_003 + self.global_step)  # reproducible dropout
            for i, (part, count) in enumerate(zip(micro, counts)):
                # FSDP gathers parameters inside every forward, so there every rank runs every micro-batch.
                if count == 0 and (i < last or self.collective.world_size == 1) and not self.sharded:
                    continue
                with self._strategy.no_sync(self._train_model) if i < last else contextlib.nullcontext():
                    loss = self._micro_loss(batch, part, count)
                    self._scaler.scale(loss / per_rank).backward()
                loss_sum += float(loss.detach())
        return loss_sum

    def _micro_loss(self, batch: Batch, part: Batch | None, count: int) -> torch.Tensor:
        """The summed answer-token loss of one micro-batch under autocast."""
        with autocast(self.device, self.settings.precision):
            # A rank with nothing to learn from still joins the last all-reduce, with zero gradients.
            if not count:
                return self._zero_loss(batch)
            assert part is not None  # labelled_positions counts 0 for an empty (None) micro-batch
            return self._train_model(part.input_ids, part.attention_mask, part.labels)

    def _optimizer_step(self) -> None:
        """Clip the global gradient norm and step (skipped, and the scale lowered, if fp16 gradients overflowed)."""
        self._scaler.unscale_(self._optimizer)
        torch.nn.utils.clip_grad_norm_(self._params, self.settings.max_grad_norm)
        self._scaler.step(self._optimizer)
        self._scaler.update()
        self.global_step += 1

    def _step_record(self, batch: Batch, loss: float, seconds: float) -> dict[str, Any]:
        """One --results line per optimiser step: time, throughput, memory and what the all-reduce sent."""
        record = {"event": "step", "time": time.time(), "step": self.global_step, "strategy": self.strategy,
                  "world_size": self.collective.world_size, "loss": None if math.isnan(loss) else loss,
                  "step_ms": round(1000 * seconds, 3), "tokens": batch.num_tokens,
                  "tokens_per_s": batch.num_tokens / seconds if seconds > 0 else None,
                  "peak_memory_mb": peak_memory_mb(self.device)}
        if self.comm_meter is not None:
            record["comm_compress"] = self.parallel.comm_compress
            record.update(self.comm_meter.take())
        return record

    def _zero_loss(self, batch: Batch) -> torch.Tensor:
        """A loss of exactly zero that still touches every LoRA parameter (for DDP's gradient all-reduce)."""
        one = (slice(0, 1), slice(0, 1))  # one position, so there is no label to predict (AnswerCrossEntropy.zero_loss)
        return self._train_model(batch.input_ids[one], batch.attention_mask[one], batch.labels[one])

    def eval_loss(self, examples: Sequence[Example], batch_size: int = 8) -> float:
        """Mean answer-token loss of the current adapter on examples (deterministic, no grad)."""
        return evaluate_loss(self._answer_loss, self.base.tokenizer, examples, max_seq_len=self.settings.max_seq_len,
                             batch_size=batch_size, device=self.device)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter weights as float32 CPU copies, keyed as peft.get_peft_model_state_dict keys them.

        Sharded: rank 0's gathered copy as of the last train_steps (or load); the other ranks have none.
        """
        if self.sharded:
            if self._gathered is None:
                raise RuntimeError("only rank 0 keeps the gathered adapter of a sharded model; "
                                   "call gathered_state() on every rank instead")
            return {key: value.clone() for key, value in self._gathered.items()}
        return {key: value.detach().to("cpu", torch.float32).clone().contiguous() for key, value in self._adapter.items()}

    def gathered_state(self) -> dict[str, torch.Tensor]:
        """The full adapter on every rank (a collective when sharded: all ranks call it together)."""
        if self.sharded:
            return gather_full(self._adapter, keep=True)
        return self.adapter_state()

    def share_primary_weights(self) -> None:
        """Every rank continues from rank 0's adapter (a collective: all ranks call it together)."""
        if not self.sharded:
            self.load_adapter_state(self.collective.broadcast_state(self.adapter_state()))
            return
        broadcast_into(self._adapter, self._gathered if self.collective.is_primary else None,
                       self.collective.device)

    def load_adapter_state(self, state: dict[str, torch.Tensor]) -> None:
        """Overwrite the adapter with state; keys and shapes must match exactly and values be finite.

        The optimiser's moments are kept: a pulled adapter continues the same expert's trajectory.
        """
        _check_adapter_state(self._adapter, state)
        if self.sharded:  # this rank's shards now; the others take theirs in share_primary_weights
            load_full(self._adapter, state)
            if self.collective.is_primary:
                self._gathered = {key: value.detach().to("cpu", torch.float32).clone() for key, value in state.items()}
            return
        with torch.no_grad():
            for key, target in self._adapter.items():
                target.copy_(state[key])


def _check_adapter_state(expected: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> None:
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"adapter state does not match this model: {len(missing)} missing keys "
                         f"{missing[:3]}, {len(unexpected)} unexpected keys {unexpected[:3]}")
    for key, target in expected.items():
        value = state[key]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise ValueError(f"adapter state {key}: expected a floating-point tensor, got {type(value).__name__}")
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"adapter state {key}: shape {tuple(value.shape)} != expected {tuple(target.shape)}")
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"adapter state {key}: contains NaN or infinity")
