"""How the ranks of one data-parallel worker hold the model: DDP replicas or FSDP2 shards.

- `ddp`: every rank keeps the whole model and optimiser; one gradient all-reduce per step
  (optionally compressed by a comm hook, worker/comm_hooks.py).
- `fsdp`: parameters, gradients and optimiser state are sharded across ranks and every
  layer's parameters are all-gathered for its forward and again for its backward (ZeRO-3-like).
- `fsdp-grad-op`: gradients and optimiser state are sharded, parameters stay gathered from
  forward to backward (ZeRO-2-like: one all-gather per step instead of two, more memory).
- `auto` picks by parameter count (DDP under 1B, fsdp-grad-op to 7B, fsdp above) and logs why.

FSDP here is torch's FSDP2 (`torch.distributed.fsdp.fully_shard`): each decoder layer is one
shard group, the rest of the model (embeddings, norm, head) the root group. It runs on CPU ranks
over gloo as well as on CUDA over NCCL.
"""
from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.nn.parallel import DistributedDataParallel

from worker.choices import STRATEGY_CHOICES
from worker.distributed import DistributedSetupError, SingleProcess

log = logging.getLogger(__name__)

SHARDED = ("fsdp", "fsdp-grad-op")
# auto: a full replica per rank is cheapest while it fits (one all-reduce per step); sharding gradients
# and optimiser state (~12 bytes per parameter with AdamW) pays from ~1B; sharding parameters too from ~7B.
AUTO_DDP_BELOW = 1_000_000_000
AUTO_GRAD_OP_BELOW = 7_000_000_000


@dataclass(frozen=True)
class ParallelSettings:
    strategy: str = "auto"
    """auto, ddp, fsdp (ZeRO-3-like) or fsdp-grad-op (ZeRO-2-like); matters only under torchrun."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimiser state in CPU memory (FSDP strategies only)."""
    comm_compress: str | None = None
    """Codec for DDP's gradient all-reduce (fp16, bf16, powersgd, int8, topk, ...); None sends float32."""
    comm_config: dict[str, Any] = field(default_factory=dict)
    """Options of comm_compress, e.g. {"ratio": 0.01} for topk or {"matrix_approximation_rank": 2}."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGY_CHOICES:
            raise DistributedSetupError(f"--strategy must be one of {', '.join(STRATEGY_CHOICES)}, "
                                        f"got {self.strategy!r}")
        if self.cpu_offload and self.strategy == "ddp":
            raise DistributedSetupError("--cpu-offload conflicts with --strategy ddp (DDP keeps a full replica on "
                                        "every device); use --strategy fsdp or fsdp-grad-op")
        if self.comm_compress and self.strategy in SHARDED:
            raise DistributedSetupError(f"--comm-compress conflicts with --strategy {self.strategy} (comm hooks "
                                        "compress DDP's all-reduce; FSDP has none); use --strategy ddp")
        if self.comm_compress and self.cpu_offload:
            raise DistributedSetupError("--comm-compress conflicts with --cpu-offload (offloading needs FSDP, comm "
                                        "hooks need DDP); drop one of them")
        if not isinstance(self.comm_config, dict):
            raise DistributedSetupError(f"--comm-config must be a JSON object, got {self.comm_config!r}")
        if self.comm_config and not self.comm_compress:
            raise DistributedSetupError("--comm-config given without --comm-compress; name the codec too")
        if self.comm_compress:
            from worker.comm_hooks import check_comm_codec  # the codec registry is needed only then

            check_comm_codec(self.comm_compress, self.comm_config)


def choose_strategy(settings: ParallelSettings, num_parameters: int, world_size: int) -> str:
    """The strategy these ranks use; `auto` is resolved by model size and the reason logged."""
    if world_size == 1:
        if settings.strategy in SHARDED or settings.cpu_offload or settings.comm_compress:
            log.warning("one process: --strategy/--cpu-offload/--comm-compress apply across torchrun ranks; "
                        "training unsharded and uncompressed")
        return "single"
    if settings.strategy != "auto":
        return settings.strategy
    billions = num_parameters / 1e9
    if settings.cpu_offload:
        choice, why = "fsdp", "--cpu-offload needs a sharded strategy"
    elif settings.comm_compress:
        choice, why = "ddp", "--comm-compress hooks into DDP's all-reduce"
    elif num_parameters < AUTO_DDP_BELOW:
        choice, why = "ddp", f"{billions:.3g}B parameters < 1B: a full replica fits each rank, one all-reduce a step"
    elif num_parameters < AUTO_GRAD_OP_BELOW:
        choice, why = "fsdp-grad-op", f"{billions:.3g}B parameters in [1B, 7B): shard gradients and optimiser state"
    else:
        choice, why = "fsdp", f"{billions:.3g}B parameters >= 7B: shard parameters, gradients and optimiser state"
    log.info("--strategy auto picked %s: %s", choice, why)
    return choice


class Strategy(ABC):
    """Wraps the model for training across ranks; `shards` says whether parameters become DTensor shards."""

    name: str
    shards: ClassVar[bool] = False

    @abstractmethod
    def wrap(self, model: torch.nn.Module, collective: SingleProcess, device: str) -> torch.nn.Module:
        """The module that training steps call; for sharding strategies `model` itself, sharded in place."""

    @abstractmethod
    def no_sync(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Skip the gradient reduction for this backward (every micro-batch but the last)."""


class Unwrapped(Strategy):
    """One process: nothing to split."""

    name = "single"

    def wrap(self, model: torch.nn.Module, collective: SingleProcess, device: str) -> torch.nn.Module:
        return model

    def no_sync(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class Replicated(Strategy):
    """DistributedDataParallel, with the comm hook of --comm-compress if any."""

    name = "ddp"

    def __init__(self, settings: ParallelSettings, meter: Any = None):
        self.settings = settings
        self.meter = meter

    def wrap(self, model: torch.nn.Module, collective: SingleProcess, device: str) -> torch.nn.Module:
        wrapped = collective.wrap(model, device)
        if self.settings.comm_compress:
            from worker.comm_hooks import register_comm_hook

            assert isinstance(wrapped, DistributedDataParallel)  # comm hooks need DDP (ParallelSettings checks)
            register_comm_hook(wrapped, self.settings.comm_compress, self.settings.comm_config, self.meter)
        return wrapped

    def no_sync(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        return module.no_sync()  # type: ignore[operator]  # a DDP module; Module.__getattr__ is typed as Tensor


class Sharded(Strategy):
    """FSDP2: each decoder layer a shard group, the rest of the model the root group."""

    shards = True

    def __init__(self, name: str, reshard_after_forward: bool, cpu_offload: bool):
        self.name = name
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload

    def wrap(self, model: torch.nn.Module, collective: SingleProcess, device: str) -> torch.nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        # Pinned memory needs CUDA; CPU ranks offload to ordinary memory (a no-op move, kept for parity).
        policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.cpu_offload else OffloadPolicy()
        layers = decoder_layers(model)
        if not layers:
            raise DistributedSetupError(f"--strategy {self.name}: found no decoder layers to shard in "
                                        f"{type(model).__name__}; use --strategy ddp")
        for layer in layers:
            fully_shard(layer, reshard_after_forward=self.reshard_after_forward, offload_policy=policy)
        fully_shard(model, reshard_after_forward=self.reshard_after_forward, offload_policy=policy)
        return model

    @contextlib.contextmanager
    def no_sync(self, module: torch.nn.Module):
        sharded: Any = module  # an FSDPModule once fully_shard ran; torch types that as a plain Module
        sharded.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            sharded.set_requires_gradient_sync(True)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks (Qwen2DecoderLayer, LlamaDecoderLayer, ...) in module order."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def make_strategy(name: str, settings: ParallelSettings, meter: Any = None) -> Strategy:
    """The Strategy called `name` (a choose_strategy result)."""
    builders = {
        "single": lambda: Unwrapped(),
        "ddp": lambda: Replicated(settings, meter),
        "fsdp": lambda: Sharded("fsdp", reshard_after_forward=True, cpu_offload=settings.cpu_offload),
        "fsdp-grad-op": lambda: Sharded("fsdp-grad-op", reshard_after_forward=False,
                                        cpu_offload=settings.cpu_offload),
    }
    return builders[name]()
