"""Moving a sharded (FSDP2 DTensor) adapter between its shards and the full tensors the coordinator sees.

Every function here is a collective: all ranks call it with the same keys in the same order.
They work one tensor (one module's weight) at a time, so a rank never holds more than one gathered
tensor beyond what it keeps (rank 0 keeps the full adapter because it pushes it).
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor


def gather_full(params: Mapping[str, torch.Tensor], keep: bool) -> dict[str, torch.Tensor]:
    """Float32 CPU copies of the full tensors, gathered one at a time; {} unless keep (the others help only)."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in params.items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if keep:
                out[key] = full.detach().to("cpu", torch.float32).clone().contiguous()
            del full
    return out


def load_full(params: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> None:
    """Write each full tensor of state into this rank's shard of the matching parameter (no communication)."""
    with torch.no_grad():
        for key, target in params.items():
            copy_into(target, state[key])


def copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """target <- full, where target may be a DTensor shard: this rank keeps its own slice of full."""
    if isinstance(target, DTensor):
        # src_data_rank=None: every rank slices the full tensor it already has, nothing is sent.
        piece = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(piece.to_local())
    else:
        target.copy_(full)


def broadcast_into(params: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor] | None,
                   device: torch.device | str, src: int = 0) -> None:
    """Rank src's full tensors (state; None elsewhere) into every rank's shards, one tensor in flight at a time.

    device is the collective's (cuda for NCCL, cpu for gloo), whatever device the shards live on.
    """
    with torch.no_grad():
        for key, target in params.items():
            if state is not None:
                full = state[key].to(device, torch.float32).contiguous()
            else:
                full = torch.empty(tuple(target.shape), dtype=torch.float32, device=device)
            dist.broadcast(full, src=src)
            copy_into(target, full)
            del full
