"""Worker-level differential privacy for the coordinator: DP-FedAvg (McMahan, Ramage, Talwar and Zhang,
ICLR 2018, "Learning Differentially Private Recurrent Language Models").

One aggregation step of an expert, with K the step's buffer size (fixed by configuration, not by who
happened to push):

    Delta = ( sum_w clip(delta_w, C) + N(0, sigma^2 C^2 I) ) / K          expert += server_lr * Delta

``clip`` scales a worker's whole update (every tensor together) down to L2 norm at most C, so adding or
removing one worker changes the sum by at most C: the Gaussian mechanism with noise multiplier sigma.
A worker that pushed twice into one buffer is one contribution (its updates are summed, then clipped),
or the sensitivity would be 2C. The equal 1/K weights are deliberate: sample-count weights would let a
worker's own data decide how much it counts. The privacy spent per step is accounted by
``privacy.accountant`` with sample rate 1 (the coordinator does not sample workers at random).

With secure aggregation the coordinator never sees one update, so the noise cannot be added there:
each of the K workers of a cohort clips its update and adds N(0, sigma^2 C^2 / K) itself
(``privacy.secagg.noise``), and the cohort's sum carries N(0, sigma^2 C^2) as intended. If only m < K of
them survive, the sum carries sigma * sqrt(m / K) (``effective_noise_multiplier``), which is what is
accounted for that step.

Noise comes from a generator seeded from the operating system's entropy unless a test passes a seed:
noise drawn from a seed an observer can guess is noise it can subtract. Floating-point Gaussian samples
are not hardened against the attacks on their low bits (Mironov 2012; Jin et al. 2022, arXiv:2112.05307).
"""
from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from privacy.accountant import DEFAULT_ACCOUNTANT, PrivacyError, check_delta

Delta = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class DPFedAvgSettings:
    """The coordinator's worker-level DP (``--dp-clip``, ``--dp-noise``, ``--dp-delta``, ``--dp-budget``)."""

    clip_norm: float
    """C: every worker's contribution to a step is scaled down to at most this L2 norm (all tensors together)."""
    noise_multiplier: float
    """sigma: each step adds Gaussian noise of standard deviation sigma x C to the sum of contributions."""
    delta: float = 1e-5
    """The delta of the (epsilon, delta) reported; keep it well below 1 / number of workers."""
    budget: float | None = None
    """Largest epsilon an expert may spend; a step that would exceed it is refused (None: report only)."""
    accountant: str = DEFAULT_ACCOUNTANT
    """privacy.accountant.ACCOUNTANTS name: rdp or prv."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise PrivacyError(f"--dp-clip must be a positive L2 norm, got {self.clip_norm!r}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0):
            raise PrivacyError(f"--dp-noise must be a positive noise multiplier, got {self.noise_multiplier!r}")
        check_delta(self.delta)
        if self.budget is not None and not (math.isfinite(self.budget) and self.budget > 0):
            raise PrivacyError(f"--dp-budget must be a positive epsilon, got {self.budget!r}")

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise added to each step's sum of contributions: sigma x C."""
        return self.noise_multiplier * self.clip_norm


def noise_generator(seed: int | None = None) -> torch.Generator:
    """A CPU generator for DP noise: from ``seed`` (tests) or else from the OS's entropy (everything else)."""
    generator = torch.Generator()
    generator.manual_seed(secrets.randbits(63) if seed is None else seed)
    return generator


def update_norm(delta: Delta) -> float:
    """The L2 norm of a whole update, every tensor together (accumulated in float64)."""
    total = 0.0
    for value in delta.values():
        total += float(torch.sum(value.detach().to(torch.float64) ** 2))
    return math.sqrt(total)


def clip_update(delta: Delta, clip_norm: float) -> tuple[dict[str, torch.Tensor], float]:
    """(delta scaled to L2 norm <= clip_norm, its norm before clipping). A copy in float32; delta is untouched."""
    norm = update_norm(delta)
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return {name: value.detach().to(torch.float32) * scale for name, value in delta.items()}, norm


def gaussian_noise(shapes: Iterable[tuple[str, Sequence[int]]], std: float,
                   generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Independent N(0, std^2) for every element of tensors of the given (name, shape)s, in float32."""
    return {name: torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * std for name, shape in shapes}


def worker_contributions(updates: Sequence[tuple[str, Delta]]) -> list[dict[str, torch.Tensor]]:
    """One summed delta per worker, in order of first appearance: the unit whose influence is clipped."""
    summed: dict[str, dict[str, torch.Tensor]] = {}
    for worker, delta in updates:
        if worker not in summed:
            summed[worker] = {name: value.detach().to(torch.float32).clone() for name, value in delta.items()}
        else:
            for name, value in delta.items():
                summed[worker][name].add_(value.to(torch.float32))
    return list(summed.values())


@dataclass(frozen=True)
class StepReport:
    """What one DP-FedAvg step did: the contributions' norms before clipping and how many were clipped."""

    norms: tuple[float, ...]
    clipped: int


def dp_fedavg_step(current: dict[str, torch.Tensor], contributions: Sequence[Delta], settings: DPFedAvgSettings,
                   denominator: int, server_lr: float, generator: torch.Generator) -> StepReport:
    """``current += server_lr * (sum clip(c) + N(0, (sigma C)^2)) / denominator``, in place.

    ``contributions`` are one per worker (``worker_contributions``); ``denominator`` is the configured buffer
    size K, fixed in advance so that it does not depend on who pushed.
    """
    if denominator < len(contributions):
        raise PrivacyError(f"{len(contributions)} contributions in a step whose fixed size is {denominator}")
    shapes = [(name, tuple(value.shape)) for name, value in current.items()]
    total = gaussian_noise(shapes, settings.noise_std, generator)
    norms = []
    for delta in contributions:
        clipped, norm = clip_update(delta, settings.clip_norm)
        norms.append(norm)
        for name, value in clipped.items():
            total[name].add_(value)
    for name, value in total.items():
        current[name].add_(value.to(current[name].dtype), alpha=server_lr / denominator)
    return StepReport(tuple(norms), sum(1 for n in norms if n > settings.clip_norm))


def effective_noise_multiplier(noise_multiplier: float, survivors: int, cohort_size: int) -> float:
    """sigma carried by the sum of ``survivors`` of a cohort of K whose members each added sigma C / sqrt(K)."""
    if not 1 <= survivors <= cohort_size:
        raise PrivacyError(f"survivors must be between 1 and the cohort size {cohort_size}, got {survivors!r}")
    return noise_multiplier * math.sqrt(survivors / cohort_size)
