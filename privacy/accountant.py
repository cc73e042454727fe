"""How much privacy a run of Gaussian mechanisms has spent, as (epsilon, delta), with Opacus's accountants.

Both kinds of differential privacy here are sequences of *sampled Gaussian mechanisms*: a sum of
contributions each clipped to L2 norm C, plus Gaussian noise of standard deviation sigma x C
(sigma = ``noise_multiplier``), where each contribution is in the sum with probability
``sample_rate`` (q):

- DP-SGD inside a worker (example-level): one mechanism per optimiser step, q = batch / examples,
  as the batches are Poisson-sampled (worker/dp_sgd.py);
- DP-FedAvg at the coordinator (worker-level, McMahan et al. 2018, "Learning Differentially Private
  Recurrent Language Models"): one mechanism per aggregation step of an expert. The coordinator does
  not sample workers at random (whoever pushes is aggregated), so q = 1: no amplification by
  sampling is claimed, and every step costs the full Gaussian mechanism's privacy.

The arithmetic is Opacus's (``opacus.accountants``: RDP by Mironov 2017 / Mironov, Talwar and Zhang
2019 with the conversion of Balle et al. 2020; PRV by Gopi, Lee and Wutschitz 2021), not ours. A
``PrivacyLedger`` keeps the history as segments of identical steps, so an expert whose noise
setting changed between restarts is still accounted exactly.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opacus.accountants import IAccountant

ACCOUNTANTS = ("rdp", "prv")
"""Opacus's accountants by name; RDP is the default (exact for q = 1, and what Opacus and TF Privacy report)."""
DEFAULT_ACCOUNTANT = "rdp"


class PrivacyError(ValueError):
    """A privacy setting that cannot be honoured (a bad noise multiplier, delta, budget ...)."""


@dataclass(frozen=True)
class GaussianSteps:
    """``steps`` sampled Gaussian mechanisms with the same noise multiplier and sample rate."""

    noise_multiplier: float
    """sigma: the noise's standard deviation in units of the clipping norm C."""
    sample_rate: float
    """q: the probability that a given contribution takes part in a step (1: no sampling)."""
    steps: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0):
            raise PrivacyError(f"noise multiplier must be a positive number, got {self.noise_multiplier!r}")
        if not 0 < self.sample_rate <= 1:
            raise PrivacyError(f"sample rate must be in (0, 1], got {self.sample_rate!r}")
        if self.steps < 0:
            raise PrivacyError(f"steps must be >= 0, got {self.steps!r}")


def check_delta(delta: float) -> float:
    """delta must be in (0, 1); it is the probability the epsilon bound may fail, so keep it << 1/records."""
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise PrivacyError(f"delta must be in (0, 1), e.g. 1e-5, got {delta!r}")
    return float(delta)


def _make_accountant(name: str) -> IAccountant:
    # Opacus is imported here, not at the top: ``import opacus`` pulls its privacy engine, scipy.stats and
    # torch.distributed.tensor (about 6 CPU seconds), which every coordinator and relay start would pay
    # although most experts never use differential privacy.
    from opacus.accountants import PRVAccountant, RDPAccountant

    return RDPAccountant() if name == "rdp" else PRVAccountant()


def epsilon_spent(history: Iterable[GaussianSteps], delta: float, accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """epsilon such that the composed history is (epsilon, delta)-DP; 0.0 when no step was taken."""
    check_delta(delta)
    segments = [(s.noise_multiplier, s.sample_rate, s.steps) for s in history if s.steps > 0]
    if not segments:
        return 0.0
    if accountant not in ACCOUNTANTS:
        raise PrivacyError(f"unknown accountant {accountant!r}; choose from {', '.join(sorted(ACCOUNTANTS))}")
    engine = _make_accountant(accountant)
    engine.history = segments  # Opacus keeps exactly this list of (sigma, q, steps)
    with warnings.catch_warnings():  # "optimal order is the largest alpha": the bound is still valid
        warnings.simplefilter("ignore")
        return float(engine.get_epsilon(delta=delta))


def noise_multiplier_for(epsilon: float, delta: float, steps: int, sample_rate: float = 1.0,
                         accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """The smallest sigma (to Opacus's tolerance, 0.01) whose ``steps`` mechanisms spend at most epsilon."""
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise PrivacyError(f"target epsilon must be a positive number, got {epsilon!r}")
    if steps < 1:
        raise PrivacyError(f"steps must be >= 1, got {steps!r}")
    check_delta(delta)
    from opacus.accountants.utils import get_noise_multiplier  # lazily, as in _make_accountant

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate,
                                          steps=steps, accountant=accountant))


@dataclass
class PrivacyLedger:
    """The privacy one expert (or one worker's DP-SGD run) has spent so far, and its budget.

    Steps are recorded only once they happened; ``allows`` answers whether one more step would still
    fit the budget, which is what refuses a step before it is taken.
    """

    delta: float
    """The delta every epsilon here is stated for."""
    budget: float | None = None
    """Largest epsilon allowed (None: no limit, spending is only reported)."""
    accountant: str = DEFAULT_ACCOUNTANT
    history: list[GaussianSteps] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_delta(self.delta)
        if self.budget is not None and not (math.isfinite(self.budget) and self.budget > 0):
            raise PrivacyError(f"privacy budget must be a positive epsilon, got {self.budget!r}")
        if self.accountant not in ACCOUNTANTS:
            raise PrivacyError(f"unknown accountant {self.accountant!r}; choose from {', '.join(sorted(ACCOUNTANTS))}")

    @property
    def steps(self) -> int:
        return sum(s.steps for s in self.history)

    def epsilon(self) -> float:
        return epsilon_spent(self.history, self.delta, self.accountant)

    def epsilon_after(self, noise_multiplier: float, sample_rate: float = 1.0, steps: int = 1) -> float:
        """The epsilon spent if ``steps`` more mechanisms were recorded (nothing is recorded)."""
        return epsilon_spent([*self.history, GaussianSteps(noise_multiplier, sample_rate, steps)], self.delta,
                             self.accountant)

    def allows(self, noise_multiplier: float, sample_rate: float = 1.0) -> bool:
        """True if one more step keeps epsilon within the budget (always, without a budget)."""
        return self.budget is None or self.epsilon_after(noise_multiplier, sample_rate) <= self.budget

    def record(self, noise_multiplier: float, sample_rate: float = 1.0, steps: int = 1) -> None:
        """Book ``steps`` mechanisms that happened; consecutive identical ones share one segment."""
        last = self.history[-1] if self.history else None
        if last is not None and (last.noise_multiplier, last.sample_rate) == (noise_multiplier, sample_rate):
            self.history[-1] = GaussianSteps(noise_multiplier, sample_rate, last.steps + steps)
        else:
            self.history.append(GaussianSteps(noise_multiplier, sample_rate, steps))

    def report(self) -> dict[str, Any]:
        """What the API and the results show: {"epsilon", "delta", "steps", "budget", "accountant"}."""
        return {"epsilon": round(self.epsilon(), 6), "delta": self.delta, "steps": self.steps,
                "budget": self.budget, "accountant": self.accountant}

    def to_json(self) -> dict[str, Any]:
        return {"delta": self.delta, "budget": self.budget, "accountant": self.accountant,
                "history": [[s.noise_multiplier, s.sample_rate, s.steps] for s in self.history]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PrivacyLedger:
        history: Sequence[Sequence[Any]] = data.get("history", ())
        return cls(delta=float(data["delta"]), budget=data.get("budget"),
                   accountant=str(data.get("accountant", DEFAULT_ACCOUNTANT)),
                   history=[GaussianSteps(float(s), float(q), int(n)) for s, q, n in history])
