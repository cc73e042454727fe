"""GaLore: Adam in a low-rank projection of each weight matrix's gradient, for full-parameter experts.

Zhao, Zhang, Chen, Wang, Anandkumar and Tian, "GaLore: Memory-Efficient LLM Training by Gradient
Low-Rank Projection" (ICML 2024, arXiv:2403.03507), Algorithm 1. For an m x n weight with gradient
G, every `update_interval` steps the top-`rank` singular vectors of G give a projection P (the
right ones, r x n, when m >= n; else the left ones, m x r). Adam's moments live in the projected
space R = G P^T (or P^T G), so they take 2 r max(m, n) numbers instead of 2 m n; the
bias-corrected Adam direction N is projected back, scaled by `scale`, and applied:

    W <- W - lr * scale * N P      (or P N)

As in the paper, the moments are kept, not rotated, when P is refreshed. Parameters without a
projection (vectors, embeddings) get the same Adam update unprojected, which is exactly
torch.optim.AdamW's. Decoupled weight decay is applied the way torch.optim.AdamW applies it.

The published `galore-torch` package is not used: its `__init__` imports bitsandbytes (a CUDA
library) and its optimizer keeps a Python projector object in the state, which only pickle can
save. Here every piece of state is a tensor or a number, so worker.checkpoint stores it in
safetensors + JSON like AdamW's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch


@dataclass(frozen=True)
class GaLoreSettings:
    rank: int = 128
    """Rank r of the gradient projection (the paper: 128 for 60M-350M models, 512 for 1B)."""
    update_interval: int = 200
    """Steps T between two SVDs of the gradient (the paper's subspace change frequency, 200)."""
    scale: float = 0.25
    """alpha, the scale of the projected-back update (the paper's 0.25)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"--galore-rank must be at least 1, got {self.rank!r}")
        if self.update_interval < 1:
            raise ValueError(f"--galore-update-interval must be at least 1 step, got {self.update_interval!r}")
        if not self.scale > 0:
            raise ValueError(f"--galore-scale must be positive, got {self.scale!r}")


def projection(grad: torch.Tensor, rank: int) -> torch.Tensor:
    """The top-rank singular vectors of grad: right ones (r x n) when m >= n, else left ones (m x r)."""
    full = grad if grad.dtype in (torch.float32, torch.float64) else grad.float()  # no SVD in half precision
    u, _, vh = torch.linalg.svd(full, full_matrices=False)
    return vh[:rank] if grad.shape[0] >= grad.shape[1] else u[:, :rank]


def project(grad: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """R = G P^T (m x r) when m >= n (a right basis), P^T G (r x n) otherwise."""
    return grad @ basis.T if grad.shape[0] >= grad.shape[1] else basis.T @ grad


def project_back(low: torch.Tensor, basis: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The m x n update of a projected one: N P when m >= n, P N otherwise."""
    return low @ basis if shape[0] >= shape[1] else basis @ low


class GaLoreAdamW(torch.optim.Optimizer):
    """AdamW whose parameter groups may carry "rank", "update_interval" and "scale": the 2-D parameters
    of such a group are trained in GaLore's projected space, the others with plain AdamW."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def _update(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[param]
        grad = param.grad
        assert grad is not None
        projected = "rank" in group and param.dim() == 2
        if projected:
            if state.get("step", 0) % group["update_interval"] == 0:
                state["projection"] = projection(grad, min(group["rank"], *param.shape)).to(grad.dtype)
            grad = project(grad, state["projection"])
        if "exp_avg" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        correction1, correction2 = 1 - beta1 ** state["step"], 1 - beta2 ** state["step"]
        direction = state["exp_avg"] / correction1 / (state["exp_avg_sq"].sqrt() / math.sqrt(correction2) + group["eps"])
        if projected:
            direction = project_back(direction, state["projection"], param.shape) * group["scale"]
        if group["weight_decay"]:
            param.mul_(1 - group["lr"] * group["weight_decay"])
        param.add_(direction, alpha=-group["lr"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a saved state, refusing one that does not fit these parameters and groups (saved with another
        --optimizer or --galore-rank): a mismatch would otherwise surface as a shape error steps later."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param, {})
                if "exp_avg" in state:
                    _check_state(param, group, state)


def _check_state(param: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
    expected = tuple(param.shape)
    if "rank" in group and param.dim() == 2:
        basis = state.get("projection")
        if basis is None:
            raise ValueError("the saved optimizer state has no GaLore projection for a weight matrix "
                             "(saved with --optimizer adamw?)")
        rank = min(group["rank"], *param.shape)
        expected = (param.shape[0], rank) if param.shape[0] >= param.shape[1] else (rank, param.shape[1])
    if tuple(state["exp_avg"].shape) != expected:
        raise ValueError(f"the saved optimizer moments have shape {tuple(state['exp_avg'].shape)}, not {expected} "
                         "(saved with another --optimizer or --galore-rank?)")


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's state tensors take (moments, projections): what GaLore saves."""
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor))
