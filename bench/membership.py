"""Membership inference, the attacker's side: scores, AUC, TPR at a low false-positive rate, bootstrap CIs,
and the member/non-member split of one DS-1000 domain.

Scores (higher = "was trained on"), from per-example answer-token losses:
- ``loss``: minus the loss under the model the attacker holds (Yeom et al., CSF 2018);
- ``calibrated``: minus (loss under the model - loss under the base model), the reference-model attack
  (Carlini et al., S&P 2022, "Membership Inference Attacks From First Principles", with the public base
  model as the reference): an example the base model already finds easy is not evidence of membership.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worker.data import Example

SCORES = ("loss", "calibrated")


def auc(members: Sequence[float], nonmembers: Sequence[float]) -> float:
    """P(score of a random member > score of a random non-member), ties counting 1/2 (Mann-Whitney U / n m)."""
    m, n = np.asarray(members, dtype=np.float64), np.asarray(nonmembers, dtype=np.float64)
    if not len(m) or not len(n):
        raise ValueError("AUC needs at least one member and one non-member score")
    greater = (m[:, None] > n[None, :]).sum()
    ties = (m[:, None] == n[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(m) * len(n)))


def tpr_at_fpr(members: Sequence[float], nonmembers: Sequence[float], fpr: float = 0.01) -> float:
    """The largest share of members flagged by a threshold that flags at most ``fpr`` of the non-members.

    With n non-members the achievable false-positive rates are multiples of 1/n: at n < 100, "1%" means
    a threshold above every non-member's score.
    """
    n = np.sort(np.asarray(nonmembers, dtype=np.float64))[::-1]
    allowed = int(np.floor(fpr * len(n) + 1e-9))  # non-members that may score above the threshold
    threshold = n[allowed] if allowed < len(n) else -np.inf  # flag scores strictly above it
    return float(np.mean(np.asarray(members, dtype=np.float64) > threshold))


def bootstrap(members: Sequence[float], nonmembers: Sequence[float], rounds: int = 1000,
              seed: int = 0) -> dict[str, list[float]]:
    """95% percentile intervals of AUC and TPR at 1% FPR, resampling members and non-members with replacement."""
    rng = np.random.default_rng(seed)
    m, n = np.asarray(members), np.asarray(nonmembers)
    aucs, tprs = [], []
    for _ in range(rounds):
        mb, nb = rng.choice(m, len(m)).tolist(), rng.choice(n, len(n)).tolist()
        aucs.append(auc(mb, nb))
        tprs.append(tpr_at_fpr(mb, nb))
    return {"auc_ci": [float(np.percentile(aucs, 2.5)), float(np.percentile(aucs, 97.5))],
            "tpr_at_1pct_fpr_ci": [float(np.percentile(tprs, 2.5)), float(np.percentile(tprs, 97.5))]}


def attack(model_losses: Sequence[float], base_losses: Sequence[float], is_member: Sequence[bool],
           rounds: int = 1000) -> dict[str, Any]:
    """Both scores' AUC and TPR at 1% FPR (with bootstrap CIs) from per-example losses in one order."""
    losses, base = np.asarray(model_losses), np.asarray(base_losses)
    member = np.asarray(is_member, dtype=bool)
    out: dict[str, Any] = {}
    for name, score in (("loss", -losses), ("calibrated", -(losses - base))):
        ms, ns = score[member], score[~member]
        out[name] = {"auc": auc(ms, ns), "tpr_at_1pct_fpr": tpr_at_fpr(ms, ns), **bootstrap(ms, ns, rounds)}
    return out


@dataclass(frozen=True)
class MembershipSplit:
    """One domain's training problems in two halves by whole families: trained on, and never trained on."""

    domain: str
    members: tuple[Example, ...]
    nonmembers: tuple[Example, ...]


def _family_rule() -> Any:
    """data/ds1000/split.py (a script, not a package): its ``families`` groups perturbed variants of a problem."""
    path = Path(__file__).resolve().parents[1] / "data" / "ds1000" / "split.py"
    spec = importlib.util.spec_from_file_location("ds1000_split", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def membership_split(train_file: Path, domain: str, salt: str = "members") -> MembershipSplit:
    """Whole families (DS-1000's variants of one problem) go to one side, so no non-member has a near-copy
    among the members; families are dealt in sha1(salt, first problem id) order to the smaller side."""
    records = [json.loads(line) for line in train_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    groups = _family_rule().families(records)
    groups.sort(key=lambda g: hashlib.sha1(f"{salt}:{g[0]['problem_id']}".encode()).hexdigest())
    sides: tuple[list[dict], list[dict]] = ([], [])
    for group in groups:
        (sides[0] if len(sides[0]) <= len(sides[1]) else sides[1]).extend(group)
    as_examples = [tuple(Example(r["prompt"], r["reference_code"]) for r in side) for side in sides]
    return MembershipSplit(domain, as_examples[0], as_examples[1])


def dp_auc_bound(epsilon: float, delta: float, points: int = 100_001) -> float:
    """The largest AUC any membership test can reach against an (epsilon, delta)-DP mechanism.

    DP bounds every test's error rates (Kairouz, Oh and Viswanath 2015): TPR <= e^eps FPR + delta and
    TPR <= 1 - e^-eps (1 - delta - FPR); the AUC bound is the area under that envelope.
    """
    fpr = np.linspace(0.0, 1.0, points)
    tpr = np.minimum.reduce([np.exp(epsilon) * fpr + delta, 1 - np.exp(-epsilon) * (1 - delta - fpr),
                             np.ones_like(fpr)])
    return float(np.trapezoid(np.clip(tpr, 0.0, 1.0), fpr))
