"""DARE-TIES: DARE's random drop and rescale (Yu et al. 2023) in place of TIES's magnitude
trim, then TIES's sign election and disjoint mean (Yadav et al. 2023), as in mergekit and PEFT.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from gateway.merges.base import (
    Expert,
    MergeResult,
    check_experts,
    check_weights,
    merge_densely,
    parse_config,
)
from gateway.merges.dare import DareConfig, drop_and_rescale, mask_generator
from gateway.merges.ties import elect_and_merge

NAME = "dare_ties"


def dare_ties(experts: list[Expert], weights: list[float], **config: Any) -> MergeResult:
    """lam * disjoint-mean(DARE(w_i * dW_i)) under the elected signs; weights not normalised."""
    cfg = parse_config(DareConfig, config, NAME)  # same settings as DARE
    check_experts(experts)
    applied = check_weights(weights, len(experts))

    def combine(name: str, deltas: list[Tensor]) -> Tensor:
        dropped = torch.stack(
            [
                drop_and_rescale(d, cfg.p, mask_generator(cfg.seed, i, name))
                for i, d in enumerate(deltas)
            ]
        )
        return elect_and_merge(dropped) * cfg.lam

    return merge_densely(NAME, experts, applied, combine, cfg.rank, asdict(cfg))
