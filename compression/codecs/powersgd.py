"""PowerSGD (Vogels et al., 2019): rank-r approximation by one power iteration.

A tensor of shape (n, d1, d2, ...) is viewed as an n x m matrix M with
m = d1*d2*...; from a seeded Gaussian start Q0 (m x r): P = orth(M Q0),
Q = M^T P, and M is approximated by P Q^T. Payload: P (n x r) then Q (m x r),
fp32 row-major. When r(n + m) >= n m, or the tensor is not at least 2-D, the
values are sent as plain fp32 instead: both sides derive this from the shape.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from compression.base import Codec, Shape, make_rng
from compression.buffers import Reader
from compression.codecs.casts import RawFloat32
from compression.config import require_int

DENSE = RawFloat32()


@dataclasses.dataclass(frozen=True)
class PowerSGDConfig:
    """Options of the powersgd codec."""

    rank: int = 4
    """Rank r of the approximation."""
    seed: int = 0
    """Seed of the random start of the power iteration."""

    def __post_init__(self) -> None:
        require_int("rank", self.rank, 1, 1 << 16)
        require_int("seed", self.seed, 0)


def low_rank_plan(shape: Shape, rank: int) -> tuple[int, int, int] | None:
    """(n, m, r) when a rank-r factorisation is smaller than the dense matrix, else None."""
    if len(shape) < 2:
        return None
    n, m = shape[0], math.prod(shape[1:])
    r = min(rank, n, m)
    return (n, m, r) if r * (n + m) < n * m else None


class PowerSGD(Codec):
    """Low-rank factors from a single power iteration."""

    name = "powersgd"
    kind = "lowrank"
    config_class = PowerSGDConfig
    config: PowerSGDConfig

    def _encode(self, flat: np.ndarray, seed: int, shape: Shape) -> bytes:
        plan = low_rank_plan(shape, self.config.rank)
        if plan is None:
            return DENSE._encode(flat, seed, shape)
        n, m, r = plan
        matrix = flat.reshape(n, m).astype(np.float64)
        start = make_rng(self.config.seed, seed).standard_normal((m, r))
        p, _ = np.linalg.qr(matrix @ start)
        q = matrix.T @ p
        return p.astype("<f4").tobytes() + q.astype("<f4").tobytes()

    def _decode(self, reader: Reader, numel: int, shape: Shape) -> np.ndarray:
        plan = low_rank_plan(shape, self.config.rank)
        if plan is None:
            return DENSE._decode(reader, numel, shape)
        n, m, r = plan
        p = reader.array("<f4", n * r, "powersgd P").reshape(n, r).astype(np.float64)
        q = reader.array("<f4", m * r, "powersgd Q").reshape(m, r).astype(np.float64)
        return (p @ q.T).reshape(-1).astype(np.float32)
