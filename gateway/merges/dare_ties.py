"""DARE-TIES: DARE's random drop and rescale (Yu et al. 2023) in place of TIES's magnitude
trim, then TIES's sign election and disjoint mean (Yadav et al. 2023), as in mergekit and PEFT.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from torch import Tensor

from gateway.merges.base import (
    Expert,
    MergeResult,
    Scratch,
    check_experts,
    check_weights,
    merge_densely,
    parse_config,
)
from gateway.merges.dare import DareConfig, keep_mask, mask_generator
from gateway.merges.ties import SignVote

NAME = "dare_ties"


def dare_ties(experts: list[Expert], weights: list[float], **config: Any) -> MergeResult:
    """lam * disjoint-mean(DARE(w_i * dW_i)) under the elected signs; weights not normalised."""
    cfg = parse_config(DareConfig, config, NAME)  # same settings as DARE
    check_experts(experts)
    applied = check_weights(weights, len(experts))

    def combine(name: str, deltas: list[Tensor], scratch: Scratch) -> Tensor:
        vote = SignVote(deltas[0].shape, scratch)
        for i, delta in enumerate(deltas):
            if cfg.p > 0:
                delta.mul_(keep_mask(delta.shape, cfg.p, mask_generator(cfg.seed, i, name),
                                     out=scratch("kept", delta.shape)))
            vote.add(delta)
        # The vote and the mean commute with a positive scale: rescale by 1 / (1 - p) once, at the end.
        return vote.disjoint_mean().mul_(cfg.lam / (1 - cfg.p))

    return merge_densely(NAME, experts, applied, combine, cfg.rank, asdict(cfg))
