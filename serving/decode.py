"""Continuous batching: rows join a running batch by a prefill, all rows take one decode step, done rows leave.

Every row is left-padded so that the newest token of every row sits at the right edge, and the KV
cache (transformers' DynamicCache: per layer, keys and values of shape (batch, heads, positions,
dim)) has the same layout. Rows join between two decode steps: their prompts are prefilled
together in a cache of their own, which is then left-padded to the running batch's length and
concatenated along the batch. Rows leave by keeping the others' cache rows and cutting the
positions no remaining row needs. Each row's positions count its own real tokens, so padding
never shifts a row's rotary positions: a row decodes as it would alone, whoever joins or leaves.

transformers 5.23 has continuous batching of its own (``generate_batch``, ``ContinuousBatchingManager``),
but it packs every request's tokens into one flat sequence and takes one GenerationConfig for all:
neither a per-row adapter (the LoRA layers never learn which token is whose) nor per-request sampling fits.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from serving.batched_lora import AdapterBank, RowMix
from serving.schema import Sampling


@dataclass(eq=False)
class Row:
    """One request's place in the running batch."""

    adapters: tuple[tuple[str, float], ...]
    """(adapter slot, weight) pairs; empty: the base model."""
    sampling: Sampling


class RunningBatch:
    """The rows generating now, their KV cache, attention mask and the token each feeds next."""

    def __init__(self, model: nn.Module, bank: AdapterBank, pad_id: int) -> None:
        self.model, self.bank, self.pad_id = model, bank, pad_id
        self.rows: list[Row] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)
        self.last = torch.zeros(0, 1, dtype=torch.long)
        self._mix: RowMix | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, rows: Sequence[Row], prompts: Sequence[Sequence[int]]) -> Tensor:
        """Prefill ``rows`` with their prompt ids and add them to the batch; their next-token logits (n, vocab)."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        cache = DynamicCache(config=getattr(self.model, "config", None))
        with self.bank.rows(RowMix.of([r.adapters for r in rows])):
            logits = self._forward(ids, mask, cache)
        self._append(list(rows), cache, mask)
        return logits

    def step(self, tokens: Sequence[int]) -> Tensor:
        """Feed every row its token (the one picked from its last logits); the next logits (batch, vocab)."""
        ids = torch.tensor(list(tokens), dtype=torch.long).view(-1, 1)
        self.mask = torch.cat([self.mask, torch.ones(len(self.rows), 1, dtype=torch.long)], dim=1)
        with self.bank.rows(self._mix):
            return self._forward(ids, self.mask, self.cache)

    def keep(self, indices: Sequence[int]) -> None:
        """Only the rows at ``indices`` stay (in that order); positions no row needs any more are cut."""
        if len(indices) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in indices]
        if not indices:
            self.cache, self.mask = None, torch.zeros(0, 0, dtype=torch.long)
            self._mix = None
            return
        index = torch.tensor(list(indices), dtype=torch.long)
        self.mask = self.mask[index]
        start = int(self.mask.any(dim=0).long().argmax())  # first position a remaining row uses
        self.mask = self.mask[:, start:]
        assert self.cache is not None
        for layer in _layers(self.cache):
            keys, values = _states(layer)
            layer.keys, layer.values = keys[index, :, start:], values[index, :, start:]
        self._mix = RowMix.of([r.adapters for r in self.rows])

    def _forward(self, ids: Tensor, mask: Tensor, cache: DynamicCache | None) -> Tensor:
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    def _append(self, rows: list[Row], cache: DynamicCache, mask: Tensor) -> None:
        if self.cache is None:
            self.rows, self.cache, self.mask = rows, cache, mask
        else:
            width = max(self.mask.shape[1], mask.shape[1])
            for old, new in zip(_layers(self.cache), _layers(cache)):
                (old_keys, old_values), (new_keys, new_values) = _states(old), _states(new)
                old.keys = torch.cat([_left_pad(old_keys, width), _left_pad(new_keys, width)])
                old.values = torch.cat([_left_pad(old_values, width), _left_pad(new_values, width)])
            self.mask = torch.cat([F.pad(self.mask, (width - self.mask.shape[1], 0)),
                                   F.pad(mask, (width - mask.shape[1], 0))])
            self.rows = self.rows + rows
        self._mix = RowMix.of([r.adapters for r in self.rows])


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's layers, each a plain DynamicLayer: sliding-window or linear-attention layers keep other
    layouts, which rows cannot join or leave by padding and slicing."""
    layers = list(cache.layers)
    if not all(type(layer) is DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise NotImplementedError(f"continuous batching needs a plain DynamicCache; this model's has {kinds}")
    return layers  # type: ignore[return-value]  # checked just above


def _states(layer: DynamicLayer) -> tuple[Tensor, Tensor]:
    keys, values = layer.keys, layer.values
    assert keys is not None and values is not None  # filled by the prefill before any join or leave
    return keys, values


def _left_pad(states: Tensor, width: int) -> Tensor:
    """(batch, heads, positions, dim) padded with zeros on the left to ``width`` positions (masked out)."""
    return F.pad(states, (0, 0, width - states.shape[2], 0))


def pick_tokens(logits: Tensor, samplings: Sequence[Sampling], generator: torch.Generator) -> list[int]:
    """Each row's next token: the most likely for greedy rows, else sampled at its temperature and top_p.

    The logits are shifted by their maximum before the temperature divides them, so a tiny temperature
    sends every other token to exp(-inf) = 0 instead of overflowing into NaN.
    """
    tokens = logits.argmax(dim=-1).tolist()
    for i, sampling in enumerate(samplings):
        if sampling.greedy:
            continue
        scaled = (logits[i].double() - logits[i].max()) / sampling.temperature
        probs = torch.softmax(scaled, dim=-1)
        if sampling.top_p < 1:
            probs = _nucleus(probs, sampling.top_p)
        tokens[i] = int(torch.multinomial(probs, 1, generator=generator))
    return tokens


def _nucleus(probs: Tensor, top_p: float) -> Tensor:
    """The smallest set of most likely tokens whose probability reaches top_p, renormalised."""
    ordered, order = probs.sort(descending=True)
    before = ordered.cumsum(0) - ordered  # mass of the tokens ranked above each one
    ordered[before >= top_p] = 0
    kept = torch.zeros_like(probs).scatter_(0, order, ordered)
    return kept / kept.sum()
