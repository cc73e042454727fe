"""Many LoRA adapters in one batch: every row's low-rank term from stacked factors, two GEMMs per layer.

PEFT's per-row path (``adapter_names``) splits every LoRA layer's input by adapter and runs each
adapter on its own rows; on CPU that split costs more than the low-rank terms themselves (a batch
of three experts ran at 0.36-0.60 of one expert's speed). S-LoRA (Sheng et al., 2023,
arXiv:2311.03285) and Punica (Chen et al., 2023, arXiv:2310.18547) serve batches of many adapters
at close to one adapter's speed by gathering each row's factors from stacked adapter weights in one
batched kernel (Punica's SGMV). With a handful of adapters per batch on a CPU the cheapest form of
that gather is dense: the factors of the adapters present in the batch are stacked along the rank,

    A_cat = [A_1; A_2; ...; A_k]  (R x in),    B_cat = [s_1 B_1, s_2 B_2, ..., s_k B_k]  (out x R),

and each row keeps its own adapter's rank columns through a per-row weight w (batch x R):

    y = W x + ((x A_cat^T) * w) B_cat^T

Two plain GEMMs and one elementwise product per layer, whatever the mix, no split by adapter. The
same weights express a soft mixture: a row with weights p_1..p_k over k experts gets
sum_i p_i s_i B_i A_i x, several LoRA deltas in one forward, never merged per request. A row of the
base model has all-zero weights. The cost is that of one adapter whose rank R is the summed ranks of
the adapters in the batch (three rank-8 experts and the rank-24 gateway: R = 48, against 576-1536
wide projections in SmolLM2-135M); the stack is rebuilt only when that set of adapters changes.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from gateway.export import PEFT_PREFIX, ExportError, check_adapter
from gateway.lora import split_modules


@dataclass(frozen=True, eq=False)
class RowMix:
    """Which adapters the rows of one forward use, and how much of each."""

    slots: tuple[str, ...]
    """The adapters present in the batch (each at most once), in column order."""
    weights: Tensor
    """(batch, len(slots)) float: row b's weight of slot j (0: not used; one adapter: 1)."""
    expanded: dict[tuple[int, ...], Tensor | None] = field(default_factory=dict)
    """Rank-column weights per column layout, made once per forward and shared by every layer with that
    layout (None: every row weighs every column 1, as in a batch of one adapter: no product needed)."""

    def columns(self, layout: tuple[int, ...], index: Tensor, dims: int, dtype: torch.dtype) -> Tensor | None:
        """The (batch, 1, ..., R) weights of the rank columns whose slots ``index`` names."""
        if layout not in self.expanded:
            weights = self.weights[:, index].to(dtype)
            ones = bool((weights == 1).all())
            self.expanded[layout] = None if ones else weights.view(weights.shape[0], *[1] * (dims - 2),
                                                                     weights.shape[1])
        return self.expanded[layout]

    @staticmethod
    def of(rows: Sequence[Sequence[tuple[str, float]]]) -> RowMix | None:
        """From each row's (slot, weight) pairs; None when no row uses any adapter (the base model)."""
        slots = tuple(dict.fromkeys(slot for row in rows for slot, _ in row))
        if not slots:
            return None
        weights = torch.zeros(len(rows), len(slots))
        column = {slot: j for j, slot in enumerate(slots)}
        for i, row in enumerate(rows):
            for slot, weight in row:
                weights[i, column[slot]] += weight
        return RowMix(slots, weights)


@dataclass(frozen=True, eq=False)
class _Stack:
    slots: tuple[str, ...]
    a_t: Tensor
    """(in, R): the A factors of the slots that adapt this layer, transposed and concatenated."""
    b_t: Tensor
    """(R, out): their B factors times their scale, transposed and concatenated."""
    columns: Tensor
    """(R,) long: which slot (index into slots) each rank column belongs to."""
    layout: tuple[int, ...] = ()
    """``columns`` as a tuple: layers with the same layout share the mix's expanded weights."""


class StackedLoraLinear(nn.Module):
    """A Linear layer plus the low-rank terms of any installed adapters, chosen per row by the bank's mix."""

    def __init__(self, base: nn.Linear, bank: AdapterBank) -> None:
        super().__init__()
        self.base = base
        self.factors: dict[str, tuple[Tensor, Tensor]] = {}
        """slot -> (A (r, in), scale * B (out, r))."""
        self._bank = [bank]  # a list: not a submodule (the bank is no nn.Module, and must not be walked)
        self._stack: _Stack | None = None

    def forward(self, x: Tensor) -> Tensor:
        out = self.base(x)
        mix = self._bank[0].mix
        if mix is None:
            return out
        stack = self._stacked(mix.slots)
        if stack is None:  # no adapter of this batch adapts this layer
            return out
        low = x @ stack.a_t
        weights = mix.columns(stack.layout, stack.columns, x.dim(), x.dtype)
        if weights is not None:
            low.mul_(weights)
        flat = out.view(-1, out.shape[-1])  # the base output is a fresh tensor: add the low-rank term in place
        return flat.addmm_(low.view(-1, low.shape[-1]), stack.b_t).view(out.shape)

    def forget(self, slot: str) -> None:
        self.factors.pop(slot, None)
        self._stack = None

    def put(self, slot: str, a: Tensor, scaled_b: Tensor) -> None:
        self.factors[slot] = (a, scaled_b)
        self._stack = None

    def _stacked(self, slots: tuple[str, ...]) -> _Stack | None:
        if self._stack is not None and self._stack.slots == slots:
            return self._stack
        present = [(j, self.factors[s]) for j, s in enumerate(slots) if s in self.factors]
        if not present:
            self._stack = _Stack(slots, torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.long))
            return None
        a_t = torch.cat([a for _, (a, _) in present]).t().contiguous()
        b_t = torch.cat([b for _, (_, b) in present], dim=1).t().contiguous()
        columns = torch.cat([torch.full((a.shape[0],), j, dtype=torch.long) for j, (a, _) in present])
        self._stack = _Stack(slots, a_t, b_t, columns, tuple(columns.tolist()))
        return self._stack


class AdapterBank:
    """The base model with its adapted Linear layers wrapped; adapters added and removed by slot name.

    Only the serving engine's thread touches it: adapters change between forwards, never during one.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers: dict[str, StackedLoraLinear] = {}
        self.ranks: dict[str, int] = {}
        """slot -> rank of the installed adapter."""
        self.mix: RowMix | None = None
        """The rows' adapters of the forward running now (set by ``rows``)."""

    def install(self, slot: str, tensors: Mapping[str, Tensor], lora: Mapping[str, Any]) -> int:
        """Add an adapter (a PEFT state dict and its lora config) as ``slot``; its rank.

        Everything is checked before anything changes: an adapter that does not fit the model
        (a module it lacks, a shape that differs) raises ExportError and leaves no trace.
        """
        if slot in self.ranks:
            raise ExportError(f"adapter slot {slot!r} is already installed")
        config = check_adapter(tensors, lora)
        modules = split_modules(dict(tensors), alpha=float(config.lora_alpha), rank=int(config.r))
        planned = [(self._target(prefix), m) for prefix, m in modules.items()]
        for (name, linear), m in planned:
            if m.shape != (linear.out_features, linear.in_features):
                raise ExportError(f"the adapter's {name} update is {m.shape[0]} x {m.shape[1]}, but the base model's "
                                  f"layer is {linear.out_features} x {linear.in_features}: another base model?")
        for (name, linear), m in planned:
            layer = self._wrapped(name, linear)
            dtype = layer.base.weight.dtype
            layer.put(slot, m.A.detach().to(dtype).contiguous(), (m.B.detach() * m.scale).to(dtype).contiguous())
        self.ranks[slot] = int(config.r)
        return int(config.r)

    def remove(self, slot: str) -> None:
        for layer in self.layers.values():
            layer.forget(slot)
        self.ranks.pop(slot, None)

    @contextlib.contextmanager
    def rows(self, mix: RowMix | None) -> Iterator[None]:
        """Forwards inside use ``mix`` (None: every row is the base model)."""
        unknown = [s for s in (mix.slots if mix else ()) if s not in self.ranks]
        if unknown:
            raise KeyError(f"adapter slot(s) {unknown} are not installed")
        self.mix = mix
        try:
            yield
        finally:
            self.mix = None

    def _target(self, prefix: str) -> tuple[str, nn.Linear]:
        name = prefix[len(PEFT_PREFIX):]
        if name in self.layers:
            return name, self.layers[name].base
        try:
            module = self.model.get_submodule(name)
        except AttributeError:
            raise ExportError(f"the adapter adapts {name!r}, which the base model does not have") from None
        if not isinstance(module, nn.Linear):
            raise ExportError(f"the adapter adapts {name!r}, a {type(module).__name__}, not a Linear layer")
        return name, module

    def _wrapped(self, name: str, linear: nn.Linear) -> StackedLoraLinear:
        if name not in self.layers:
            parent_name, _, child = name.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            self.layers[name] = StackedLoraLinear(linear, self)
            setattr(parent, child, self.layers[name])
        return self.layers[name]
