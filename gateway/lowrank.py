"""Exact low-rank algebra on LoRA modules: concatenation and truncated-SVD re-factorisation.

Everything here returns factors whose product is the intended full update, either exactly
(concatenation) or as its best rank-k approximation with the Frobenius error measured, so a
merge can always say how far its adapter is from the update it meant to build.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from gateway.lora import LoraModule


@dataclass(frozen=True, eq=False)
class Refactorised:
    """A module re-factorised to lower rank, with how much of the target update it lost."""

    module: LoraModule
    """The new factors (scale 1)."""
    error: float
    """Frobenius norm of target - module.delta()."""
    norm: float
    """Frobenius norm of the target update."""

    @property
    def relative_error(self) -> float:
        return self.error / self.norm if self.norm > 0 else 0.0


def concatenate(modules: list[LoraModule], coeffs: list[float]) -> LoraModule:
    """sum_i coeffs[i] * modules[i].delta(), exactly, as one module of rank sum_i r_i.

    [B_1 c_1 s_1, ..., B_n c_n s_n] @ [A_1; ...; A_n] = sum_i c_i s_i B_i @ A_i, so stacking
    the ranks loses nothing. Terms with a zero coefficient are left out: they would only add
    rank that contributes zeros.
    """
    terms = [(c, m) for c, m in zip(coeffs, modules, strict=True) if c != 0.0]
    out_features, in_features = modules[0].shape
    if not terms:
        return LoraModule(A=torch.zeros(0, in_features), B=torch.zeros(out_features, 0), scale=1.0)
    A = torch.cat([m.A for _, m in terms], dim=0)
    B = torch.cat([m.B * (c * m.scale) for c, m in terms], dim=1)
    return LoraModule(A=A, B=B, scale=1.0)


def truncate(module: LoraModule, rank: int) -> Refactorised:
    """Best rank-`rank` approximation of module.delta(), without forming the dense update.

    With B s = Qb Rb and A^T = Qa Ra, delta = Qb (Rb Ra^T) Qa^T, so the SVD of the small
    r x r core gives the singular values of delta exactly; the error is the tail of that
    spectrum. Cost is O((out + in) r^2) instead of O(out * in * r).
    """
    if module.rank == 0:
        return Refactorised(module=module, error=0.0, norm=0.0)
    Qb, Rb = torch.linalg.qr(module.B * module.scale)
    Qa, Ra = torch.linalg.qr(module.A.T)
    U, S, Vh = torch.linalg.svd(Rb @ Ra.T)
    k = min(rank, S.numel())
    # Split sqrt(S) onto both sides so the factors stay balanced, as a trainer would expect.
    root = S[:k].sqrt()
    B = (Qb @ U[:, :k]) * root
    A = root[:, None] * (Vh[:k] @ Qa.T)
    energy = S.double().square()
    return Refactorised(
        module=LoraModule(A=A, B=B, scale=1.0),
        error=math.sqrt(energy[k:].sum().item()),
        norm=math.sqrt(energy.sum().item()),
    )


def factorise(delta: Tensor, rank: int) -> Refactorised:
    """Best rank-`rank` factors B @ A of a dense update (out x in), by truncated SVD.

    The top singular vectors come from the eigenvectors of the smaller Gram matrix (in x in
    for a tall update): several times cheaper than a full SVD of a 4864 x 896 update. Squaring
    loses accuracy only in the small singular values, which are the ones truncated away; and
    B @ A = delta V V^T is a projection whatever V is, so the error is measured on the factors
    actually returned rather than inferred from the spectrum.
    """
    out_features, in_features = delta.shape
    if out_features < in_features:
        tall = factorise(delta.T, rank)
        module = LoraModule(A=tall.module.B.T, B=tall.module.A.T, scale=1.0)
        return Refactorised(module=module, error=tall.error, norm=tall.norm)
    k = min(rank, in_features)
    _, eigenvectors = torch.linalg.eigh(delta.T @ delta)
    V = eigenvectors[:, -k:].flip(-1)  # eigh sorts ascending
    US = delta @ V  # columns are u_j * s_j
    root = US.norm(dim=0).sqrt()
    B = US / root.clamp_min(torch.finfo(delta.dtype).tiny)  # a zero column stays zero
    A = root[:, None] * V.T
    return Refactorised(
        module=LoraModule(A=A, B=B, scale=1.0),
        error=torch.linalg.norm(delta - B @ A).item(),
        norm=torch.linalg.norm(delta).item(),
    )


OVERSAMPLE = 8
"""Extra sketch directions beyond the rank (Halko, Martinsson & Tropp 2011 suggest 5-10)."""
POWER_ITERATIONS = 2
"""Subspace iterations. On TIES/DARE/DARE-TIES merges of two SmolLM2-shaped layers (three rank-8
experts, rank 24) the relative error exceeds the exact truncation's by 1e-2 to 4e-2 after none,
5e-5 to 1.7e-4 after one and at most 1.1e-5 after two (bench/merge_speed.py reports it per run)."""


def sketch_factorise(delta: Tensor, rank: int, start: Tensor | None = None) -> Refactorised:
    """Near-best rank-`rank` factors of a dense update by randomized subspace iteration.

    Only matrix products with thin (in x q) matrices plus a QR and an SVD of thin matrices: no
    eigen-decomposition of an in x in Gram matrix. That one is not only several times the work
    but, in multithreaded LAPACK on a machine whose cores are busy, 10-100x slower (measured:
    a 576 x 576 eigh took 1.5-11 s on 2 loaded cores vs 0.2 s on one thread). `start` (in x s)
    seeds the sketch with directions the update is known to lie near (the experts' A rows), the
    rest is drawn from a fixed seed so a merge is reproducible. Falls back to `factorise` when
    the sketch would cover the whole space anyway. The error is measured on the factors returned.
    """
    q = rank + OVERSAMPLE
    if q >= min(delta.shape):
        return factorise(delta, rank)
    start = delta.new_zeros(delta.shape[1], 0) if start is None else start[:, :q]
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(delta.shape[1], q - start.shape[1], generator=generator, dtype=delta.dtype)
    basis = torch.cat([start, noise], dim=1)  # in x q
    for _ in range(POWER_ITERATIONS):
        basis = delta.T @ (delta @ torch.linalg.qr(basis).Q)
    basis = torch.linalg.qr(basis).Q  # orthonormal; its span is close to delta's top right singular space
    projected = delta @ basis  # (out x q)
    U, S, Wh = torch.linalg.svd(projected, full_matrices=False)  # delta ~ U S Wh basis^T
    k = min(rank, S.numel())
    root = S[:k].sqrt()
    B = U[:, :k] * root
    A = root[:, None] * (Wh[:k] @ basis.T)
    norm = torch.linalg.norm(delta).item()
    error = factored_error(norm, projected @ Wh[:k].T * root, B, A)
    if error < CANCELLATION_GUARD * norm:  # too close to exact for the subtraction: measure it directly
        error = torch.linalg.norm(delta - B @ A).item()
    return Refactorised(module=LoraModule(A=A, B=B, scale=1.0), error=error, norm=norm)


CANCELLATION_GUARD = 0.1
"""Below this relative error `factored_error` loses digits to cancellation and the error is measured
on the dense difference instead: on an exactly rank-24 sum of SmolLM2-shaped updates cut to rank 24
the formula says 6e-5 where the dense difference says 9e-7. Dense merges sit at 0.5-0.8."""


def factored_error(norm: float, delta_At: Tensor, B: Tensor, A: Tensor) -> float:
    """||delta - B @ A||_F from ||delta||_F and delta @ A^T (out x k), without a dense product.

    ||delta - B A||^2 = ||delta||^2 - 2 <delta A^T, B> + <B^T B, A A^T>, every term but the first
    from k-column matrices. Exact for any factors (no orthonormality assumed); summed in float64,
    the terms' float32 rounding (~1e-6 of ||delta||^2) is what limits it, hence CANCELLATION_GUARD.
    """
    delta_At, B, A = delta_At.double(), B.double(), A.double()
    cross = (delta_At * B).sum().item()
    gram = ((B.T @ B) * (A @ A.T)).sum().item()
    return math.sqrt(max(norm * norm - 2 * cross + gram, 0.0))
