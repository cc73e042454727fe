"""The root's refusals, applied at a relay before it acknowledges a worker's update (202).

A relay answers 202 for an update the root has not seen yet: it forwards it later, combined with others into one
batch (coordinator/relay/forwarder.py). A batch the root then refuses (422) broke the promise for every member:
one worker pushing finite deltas of 3e38 made the root refuse the batches that carried them, and with them the
honest updates beside them. So before its 202 a relay applies the root's own rules (coordinator/checks/update_limits.py),
with the root's settings, which it learns when it joins (``POST /api/v1/relays`` answers them; kept in
relay.sqlite for a restart while the root is away):

- the update decodes to finite tensors of the expert's shapes (``checked_norm``, called by the service as at the root);
- its norm passes the root's ``--norm-check`` (``judge_norm`` over this relay's own history of accepted norms, so a
  worker behind a relay meets the check a worker pushing to the root meets; ``clip`` scales it as the root would);
- a step made of it stays finite: ``w + server_lr * delta``, w the cached root weights (why one update at a time
  promises every combination of them: coordinator/checks/update_limits.py). With ``--site-model`` the site's weights
  take its place (``SiteModel.admit``): a sum of updates, where the combination argument does not hold.

Before a batch goes upstream the forwarder applies the step rule again, to the batch as the root decodes it and
the freshest cached weights (they may have moved since the 202). What the root refuses all the same (its weights
moved with another relay's batches) is split and sent again, so that only an update the root refuses on its own
is lost (``Forwarder._refused``).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch

from coordinator.storage.blobs import BlobStore
from coordinator.checks.norm_check import NormVerdict, judge_norm
from coordinator.relay.relay_store import RelayStore
from coordinator.relay.relay_store_schema import CachedWeights
from coordinator.checks.update_limits import (UpdateLimits, check_step_result, headroom, peak_magnitude, surely_finite,
                                       weights_plus)
from protocol.streaming import FileTensorsOnce

log = logging.getLogger(__name__)

LIMITS_SETTING = "root_limits"
ROOM_KEPT = 16
"""Weights files whose headroom is remembered (a few versions of a few experts)."""


class RelayChecks:
    """The root's limits as this relay last learned them, and its rules applied with them."""

    def __init__(self, store: RelayStore, blobs: BlobStore, blobs_guard: threading.RLock) -> None:
        self.store, self.blobs, self.blobs_guard = store, blobs, blobs_guard
        self.limits = _limits_or_none(store.setting(LIMITS_SETTING)) or UpdateLimits()
        """The root's defaults until it has told us its own (a root of an older release never does)."""
        self._room: dict[str, float] = {}
        """Cached weights file (blob digest) -> its tensors' ``headroom``; used under ``blobs_guard``."""

    def learn(self, limits: Any) -> None:
        """Take the limits the root answered at registration (None: it sent none) and keep them for restarts."""
        learned = _limits_or_none(limits)
        if learned is None:
            log.warning("the upstream did not say what it refuses (an older release?): assuming its defaults, %s",
                        self.limits)
            return
        self.limits = learned
        self.store.put_setting(LIMITS_SETTING, learned.to_json())

    def judge(self, expert: str, norm: float) -> NormVerdict:
        """The root's norm check (InvalidUpdate, 422, in reject mode) over this relay's accepted norms."""
        policy = self.limits.norm
        return judge_norm(norm, self.store.recent_norms(expert, policy.history), policy)

    def check_step(self, weights: CachedWeights, delta: Mapping[str, torch.Tensor], update_id: str,
                   expert: str) -> None:
        """Refuse (422 ``result_not_finite``) ``delta`` if ``weights + server_lr * delta`` is not finite."""
        lr = self.limits.server_lr
        with self.blobs_guard:  # the cache never deletes the file while it is read
            if surely_finite(self._headroom(weights), peak_magnitude(delta), lr):
                return
            new = weights_plus(self.blobs.path(weights.blob), [(delta, lr)])
        check_step_result(new, update_id, expert)

    def check_site(self, root: Mapping[str, torch.Tensor], room: float,
                   owed: Mapping[str, torch.Tensor], update_id: str, expert: str) -> None:
        """Refuse (422) a worker update that makes what a site-model relay owes (its site's progress not in the root's
        weights ``root``, whose ``headroom`` is ``room``) overflow the site's weights ``root + owed``
        or a root step ``root + server_lr * owed`` taking it in. Both with one check: element by element
        ``root + a * owed`` moves monotonically with a, so it is finite for every a between 0 and the larger factor
        if it is at that factor."""
        alpha = max(1.0, self.limits.server_lr)
        if not surely_finite(room, peak_magnitude(owed), alpha):
            check_step_result(weights_plus(root, [(owed, alpha)]), update_id, expert)

    def _headroom(self, weights: CachedWeights) -> float:
        """``headroom`` of a cached weights file, read once per file (weights files never change)."""
        room = self._room.get(weights.blob)
        if room is None:
            if len(self._room) >= ROOM_KEPT:
                self._room.pop(next(iter(self._room)))
            room = self._room[weights.blob] = headroom(FileTensorsOnce(self.blobs.path(weights.blob)))
        return room


def _limits_or_none(data: Any) -> UpdateLimits | None:
    if data is None:
        return None
    try:
        return UpdateLimits.from_json(data)
    except ValueError as exc:
        log.warning("ignoring the upstream's limits: %s", exc)
        return None
