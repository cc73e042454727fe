"""Data parallelism inside one worker: devices, precision, and the ranks' collective operations.

`torchrun --nproc_per_node N run_worker.py ...` starts N ranks that train one expert together
with DistributedDataParallel. Only rank 0 talks to the coordinator, so the coordinator sees one
worker; the ranks stay in lockstep through a `Collective`:

- every rank draws the same seeded global batch and keeps the rows DistributedSampler would give
  it (rows rank, rank + N, ...), so the step is the single-process step on the same batch;
- rank 0 decides when to stop training and sync (`agree`), and after a sync every rank continues
  from the weights rank 0 holds (`broadcast_state`).

A plain `python run_worker.py` gets `SingleProcess`, whose operations are no-ops.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
from typing import Iterator

import torch
import torch.distributed as dist

from worker.errors import WorkerError

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda", "mps")
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# Rank 0 may spend a while in HTTP retries while the other ranks wait in a collective.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)


class DistributedSetupError(WorkerError, ValueError):
    """A device, precision or launch combination that cannot work; the message is one line for the user."""


class SingleProcess:
    """One process trains alone: every collective operation returns its input."""

    rank = 0
    world_size = 1
    device = torch.device("cpu")
    """Where collective operations run (TorchCollective: this rank's device)."""

    @property
    def is_primary(self) -> bool:
        """True on the rank that talks to the coordinator, logs and writes results."""
        return self.rank == 0

    def agree(self, flag: bool) -> bool:
        """Rank 0's flag, on every rank (e.g. "the interval is over")."""
        return flag

    def sum(self, value: float) -> float:
        """The sum of value over all ranks."""
        return value

    def broadcast_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank 0's tensors, on every rank; every rank passes tensors of the same keys and shapes."""
        return state

    def wrap(self, model: torch.nn.Module, device: str) -> torch.nn.Module:
        """The module that training steps call (DistributedDataParallel across ranks)."""
        return model

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Skip the gradient all-reduce for this backward (every micro-batch but the last)."""
        return contextlib.nullcontext()

    def check_same(self, what: str, value: str) -> None:
        """Raise DistributedSetupError unless every rank has the same value (e.g. a model fingerprint)."""

    def close(self) -> None:
        """Leave the process group."""


class TorchCollective(SingleProcess):
    """The ranks of a torch.distributed process group (NCCL on CUDA, gloo otherwise)."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def agree(self, flag: bool) -> bool:
        value = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        dist.broadcast(value, src=0)
        return bool(value.item())

    def sum(self, value: float) -> float:
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return float(total.item())

    def broadcast_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        keys = sorted(state)
        flat = torch.cat([state[k].detach().reshape(-1).to(self.device, torch.float32) for k in keys])
        dist.broadcast(flat, src=0)
        flat, out, offset = flat.cpu(), {}, 0
        for key in keys:
            n = state[key].numel()
            out[key] = flat[offset:offset + n].view_as(state[key].cpu()).clone()
            offset += n
        return out

    def wrap(self, model: torch.nn.Module, device: str) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        # The frozen base weights are identical on every rank (check_same on the fingerprint), so DDP
        # need not broadcast them at start-up, nor the buffers (rotary tables) before every forward.
        frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
        frozen += [name for name, _ in model.named_buffers()]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync()  # type: ignore[operator]  # a DDP module; Module.__getattr__ is typed as Tensor

    def check_same(self, what: str, value: str) -> None:
        values: list[str | None] = [None] * self.world_size
        dist.all_gather_object(values, value)
        if len(set(values)) != 1:
            raise DistributedSetupError(f"data-parallel ranks disagree on {what}: {sorted(set(map(str, values)))}")

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    """True when torchrun (or another env:// launcher) started this process as one of several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def resolve_device(requested: str, local_rank: int = 0, local_world_size: int = 1) -> str:
    """The torch device this rank trains on: `auto` picks cuda > mps > cpu; a rank gets cuda:<local rank>."""
    kind, _, index = requested.partition(":")
    if kind not in DEVICES or (index and (kind != "cuda" or not index.isdigit())):
        raise DistributedSetupError(f"--device must be one of {', '.join(DEVICES)} (or cuda:N), got {requested!r}")
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "mps" if _mps_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DistributedSetupError("--device cuda: no CUDA device is visible to torch; use --device cpu or auto")
        if local_world_size > 1:
            if index:
                raise DistributedSetupError("--device cuda:N with torchrun: pass --device cuda; each rank takes "
                                            "cuda:<local rank>")
            if torch.cuda.device_count() < local_world_size:
                raise DistributedSetupError(f"torchrun started {local_world_size} processes on this node but only "
                                            f"{torch.cuda.device_count()} CUDA device(s) are visible; lower "
                                            "--nproc_per_node")
            return f"cuda:{local_rank}"
        return requested if index else "cuda"
    if kind == "mps":
        if not _mps_available():
            raise DistributedSetupError("--device mps: the MPS backend is not available; use --device cpu or auto")
        if local_world_size > 1:
            raise DistributedSetupError("data-parallel training needs CUDA or CPU ranks (MPS is one device and has "
                                        "no collective backend); run one process with --device mps")
    return kind


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def check_precision(precision: str, device: str) -> None:
    """Refuse a precision the device cannot run; warn when it runs but slowly."""
    if precision not in PRECISIONS:
        raise DistributedSetupError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    kind = torch.device(device).type
    if precision == "bf16" and kind == "cuda" and not torch.cuda.is_bf16_supported():
        raise DistributedSetupError("--precision bf16: this CUDA device has no bfloat16 support; use fp16 or fp32")
    if precision == "fp16" and kind == "cpu":
        # torch 2.13 runs fp16 autocast on CPU (and a CPU GradScaler), but most CPUs lack fp16 matmul
        # kernels: measured ~6x slower than fp32 on this project's machines. Allowed, not advised.
        log.warning("--precision fp16 on CPU works but is slow on most CPUs; bf16 or fp32 is faster there")


def autocast(device: str, precision: str) -> contextlib.AbstractContextManager:
    """Mixed-precision autocast for the forward pass (a no-op for fp32); weights stay float32."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def grad_scaler(device: str, precision: str) -> torch.amp.GradScaler:
    """A loss scaler for fp16 (whose small gradients would underflow); disabled, a pass-through, otherwise."""
    return torch.amp.GradScaler(torch.device(device).type, enabled=precision == "fp16")


def start(requested_device: str) -> tuple[SingleProcess, str]:
    """(collective, device) for this process: a process group under torchrun, SingleProcess otherwise."""
    if not launched_by_torchrun():
        return SingleProcess(), resolve_device(requested_device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    device = resolve_device(requested_device, local_rank, local_world)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend=backend, timeout=COLLECTIVE_TIMEOUT)
    collective = TorchCollective(device if backend == "nccl" else "cpu")
    log.info("rank %d of %d on %s (%s)", collective.rank, collective.world_size, device, backend)
    return collective, device


@contextlib.contextmanager
def process_group(requested_device: str) -> Iterator[tuple[SingleProcess, str]]:
    """`start`, then leave the process group however the block ends."""
    collective, device = start(requested_device)
    try:
        yield collective, device
    finally:
        collective.close()
