"""Removing the masks: the aggregator's last step, from the survivors' inputs and shares.

    sum_{u in S} x_u = sum_{u in S} y_u - sum_{u in S} PRG(b_u) - (the pairwise masks between S and D)

with S the survivors and D the members that shared keys but sent no input. Pairwise masks inside S
cancel on their own. Every rebuilt secret is checked before use (a mask key against the public key
it advertised, a seed against its commitment), so one wrong share from a member cannot poison the
step unnoticed: another subset of t shares is tried, and a secret no subset rebuilds fails the step.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from privacy.secagg import keys, masking
from privacy.secagg.cohort import CohortState
from privacy.secagg.errors import BadSecAggMessage, ReconstructionError
from privacy.secagg.member import seed_commitment
from privacy.secagg.shamir import combine_shares

MAX_SUBSETS = 256
"""Subsets of t shares tried per secret before giving up (all of them for small cohorts)."""


def rebuild(shares: dict[int, bytes], threshold: int, check: Callable[[bytes], bool], what: str) -> bytes:
    """The secret behind ``shares`` that passes ``check``, trying subsets of t shares in turn."""
    subsets = itertools.combinations(sorted(shares), threshold)
    for subset in itertools.islice(subsets, MAX_SUBSETS):
        secret = combine_shares({index: shares[index] for index in subset}, threshold)
        if check(secret):
            return secret
    raise ReconstructionError(f"no {threshold} of the {len(shares)} shares rebuild {what}: a member sent bad shares")


def read_masked(data: bytes | memoryview, numel: int) -> np.ndarray:
    """A masked input off the wire or the journal: exactly ``numel + 1`` little-endian uint32 values."""
    if len(data) != 4 * (numel + 1):
        raise BadSecAggMessage(f"a masked input for this cohort is {4 * (numel + 1)} bytes, got {len(data)}")
    return np.frombuffer(data, dtype="<u4").astype(np.uint32)


def unmasked_sum(state: CohortState, load_masked: Callable[[str], np.ndarray]) -> tuple[np.ndarray, int]:
    """The survivors' weighted sum (float64) and their total weight; the cohort must be able to unmask."""
    return state.config.quant.decode_sum(unmasked_total(state, load_masked))


def unmasked_total(state: CohortState, load_masked: Callable[[str], np.ndarray]) -> np.ndarray:
    """The sum of the survivors' quantised vectors in Z_{2^32}, every mask removed."""
    if not state.can_unmask:
        raise ReconstructionError(f"cohort {state.config.cohort_id} has {len(state.answers)} unmasking answers; "
                                  f"threshold {state.threshold}")
    config, context = state.config, state.config.context
    total = np.zeros(config.numel + 1, dtype=np.uint32)
    for member in sorted(state.survivors):
        total += load_masked(member)
    for member in sorted(state.survivors):
        seed = rebuild(_shares_of(state, member, seeds=True), state.threshold,
                       _matches_commitment(state, member), f"{member}'s seed")
        masking.add_self_mask(total, seed, context, sign=-1)
    for gone in sorted(state.dropped):
        private = rebuild(_shares_of(state, gone, seeds=False), state.threshold,
                          _matches_public_key(state.keys[gone].mask), f"{gone}'s mask key")
        for member in sorted(state.survivors):
            # Remove the mask ``member`` added for the pair (member, gone): the same s, seen from ``gone``.
            pair_key = masking.pair_mask_key(private, state.keys[member].mask, context)
            masking.add_pair_masks(total, config.index_of(member), [(config.index_of(gone), pair_key)], sign=-1)
    return total


def _shares_of(state: CohortState, member: str, seeds: bool) -> dict[int, bytes]:
    """Every answering survivor's share of ``member``'s seed (or mask key), by the holder's Shamir index."""
    return {state.config.index_of(holder): (answer.seed_shares if seeds else answer.key_shares)[member]
            for holder, answer in state.answers.items()}


def _matches_commitment(state: CohortState, member: str) -> Callable[[bytes], bool]:
    return lambda seed: seed_commitment(state.config, member, seed) == state.commitments[member]


def _matches_public_key(public: bytes) -> Callable[[bytes], bool]:
    return lambda private: keys.public_of(private) == public
