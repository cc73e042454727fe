"""A worker's side of one cohort: its secrets, its shares of its peers' secrets, its masked input.

Nothing here leaves the worker in the clear: public keys, shares sealed to each peer, a hash
commitment to the self-mask seed, and the masked input. The one decision a member makes on its
own is the check of Bonawitz et al. (section 4, round 4) against a malicious aggregator: for any
peer it reveals either the share of that peer's self-mask seed (the peer survived) or the share of
its mask key (the peer dropped), never both, and it answers the unmasking round once.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from privacy.secagg import keys, masking
from privacy.secagg.config import CohortConfig
from privacy.secagg.errors import BadSecAggMessage, SecAggRefused
from privacy.secagg.noise import noise_rng
from privacy.secagg.shamir import split_secret

SEED_BYTES = 16
SEED_SHARE_BYTES = 16
KEY_SHARE_BYTES = 32


@dataclass(frozen=True)
class PublicKeys:
    """A member's advertisement: the share-encryption key and the mask key, both X25519 public."""

    cipher: bytes
    mask: bytes


@dataclass(frozen=True)
class UnmaskAnswer:
    """What a survivor reveals: shares of survivors' seeds and of dropped members' mask keys."""

    seed_shares: dict[str, bytes]
    key_shares: dict[str, bytes]


def seed_commitment(config: CohortConfig, member: str, seed: bytes) -> bytes:
    """SHA-256 over the cohort, the member and b_u: lets the aggregator check a rebuilt seed.
    b_u is 128 random bits, so the hash does not reveal it."""
    return hashlib.sha256(b"fedmoe-secagg seed v1|" + config.context + b"|" + member.encode() + b"|" + seed).digest()


def share_associated_data(config: CohortConfig, sender: str, receiver: str) -> bytes:
    return config.context + b"|" + sender.encode() + b"->" + receiver.encode()


class CohortMember:
    """One worker in one cohort. Fresh keys and seed per cohort; secrets stay in this object."""

    def __init__(self, config: CohortConfig, member: str) -> None:
        self.config = config
        self.member = member
        self.index = config.index_of(member)
        self._cipher = keys.KeyPair.generate()
        self._mask = keys.KeyPair.generate()
        self._seed = os.urandom(SEED_BYTES)
        self.roster: dict[str, PublicKeys] = {}
        """U1: the members whose keys the aggregator relayed, this one included."""
        self.held: dict[str, tuple[bytes, bytes]] = {}
        """U2: for each member that shared with us, our share of (its seed, its mask key)."""
        self.answered: tuple[frozenset[str], frozenset[str]] | None = None

    def advertisement(self) -> PublicKeys:
        return PublicKeys(cipher=self._cipher.public, mask=self._mask.public)

    def share_keys(self, roster: Mapping[str, PublicKeys]) -> tuple[dict[str, bytes], bytes]:
        """Shares of b_u and s_sk_u for each member of the roster, sealed to it; and b_u's commitment."""
        self._check_roster(roster)
        self.roster = dict(roster)
        holders = len(self.config.members)
        seeds = split_secret(self._seed, self.config.threshold, holders)
        mask_keys = split_secret(self._mask.private, self.config.threshold, holders)
        sealed = {}
        for peer, public in roster.items():
            index = self.config.index_of(peer)
            plaintext = seeds[index] + mask_keys[index]
            if peer == self.member:
                self.held[peer] = (seeds[index], mask_keys[index])
                continue
            key = keys.derive_key(self._cipher.private, public.cipher, keys.SHARE_KEY_PURPOSE, self.config.context)
            sealed[peer] = keys.seal(key, plaintext, share_associated_data(self.config, self.member, peer))
        return sealed, seed_commitment(self.config, self.member, self._seed)

    def _check_roster(self, roster: Mapping[str, PublicKeys]) -> None:
        if self.roster:
            raise SecAggRefused(f"{self.member} already shared its keys in cohort {self.config.cohort_id}")
        if roster.get(self.member) != self.advertisement():
            raise SecAggRefused("the roster does not carry this member's own keys: refusing to share")
        if len(roster) < self.config.threshold:
            raise SecAggRefused(f"a roster of {len(roster)} is below the threshold {self.config.threshold}")
        for peer in roster:
            self.config.index_of(peer)
        if len({public.mask for public in roster.values()}) != len(roster):
            raise SecAggRefused("two roster members advertise the same mask key: refusing to share")

    def receive_shares(self, sealed: Mapping[str, bytes]) -> None:
        """Open the shares the other members of U2 sealed to us (U2 = their senders and us)."""
        if not self.roster or len(self.held) != 1:
            raise SecAggRefused("shares arrive once, after this member shared its own")
        for sender, box in sealed.items():
            public = self.roster.get(sender)
            if public is None or sender == self.member:
                raise BadSecAggMessage(f"a share from {sender!r}, who is not a peer in the roster")
            key = keys.derive_key(self._cipher.private, public.cipher, keys.SHARE_KEY_PURPOSE, self.config.context)
            plain = keys.open_sealed(key, box, share_associated_data(self.config, sender, self.member))
            if len(plain) != SEED_SHARE_BYTES + KEY_SHARE_BYTES:
                raise BadSecAggMessage(f"a share from {sender!r} has {len(plain)} bytes")
            self.held[sender] = (plain[:SEED_SHARE_BYTES], plain[SEED_SHARE_BYTES:])
        if len(self.held) < self.config.threshold:
            raise SecAggRefused(f"only {len(self.held)} members shared keys; the threshold is {self.config.threshold}")

    def masked_input(self, delta: np.ndarray, num_samples: int, rounding_seed: int,
                     noise: np.random.Generator | None = None) -> np.ndarray:
        """The quantised, weighted delta plus every mask: ``numel + 1`` uint32 values.

        In a DP cohort the delta is first clipped and noised as the config says (``privacy.secagg.noise``),
        with ``noise`` (tests) or else a generator seeded from the OS's entropy, and weighted 1."""
        if len(self.held) < self.config.threshold:
            raise SecAggRefused("this member has not received enough shares to mask an input")
        if np.asarray(delta).size != self.config.numel:
            raise BadSecAggMessage(f"a delta of {np.asarray(delta).size} values for a cohort of numel {self.config.numel}")
        quant, dp = self.config.quant, self.config.dp
        if dp is not None:
            delta = dp.privatize(delta, len(self.config.members), noise or noise_rng())
        vector = quant.quantize(delta, quant.weight_of(num_samples), rounding_seed)
        masking.add_self_mask(vector, self._seed, self.config.context)
        masking.add_pair_masks(vector, self.index, (
            (self.config.index_of(peer), masking.pair_mask_key(self._mask.private, self.roster[peer].mask,
                                                               self.config.context))
            for peer in self.held if peer != self.member))
        return vector

    def unmask(self, survivors: set[str], dropped: set[str]) -> UnmaskAnswer:
        """Our shares for the unmasking round, after the check against a malicious aggregator."""
        partition = (frozenset(survivors), frozenset(dropped))
        if self.answered is not None and self.answered != partition:
            raise SecAggRefused(f"{self.member} already answered cohort {self.config.cohort_id} for another "
                                "set of survivors: giving a second set could reveal a member's input")
        both = survivors & dropped
        if both:
            raise SecAggRefused(f"asked for both the seed share and the mask-key share of {sorted(both)}: "
                                "that would unmask an individual input")
        if survivors | dropped != set(self.held):
            raise SecAggRefused("the survivors and dropped members must be exactly the members that shared keys")
        if self.member not in survivors or len(survivors) < self.config.threshold:
            raise SecAggRefused(f"{len(survivors)} survivors (this member among them: {self.member in survivors}) "
                                f"cannot make a step of threshold {self.config.threshold}")
        self.answered = partition
        return UnmaskAnswer(seed_shares={u: self.held[u][0] for u in survivors},
                            key_shares={v: self.held[v][1] for v in dropped})
