"""Each expert's privacy spending at this coordinator: the worker-level DP-FedAvg ledger (--dp-noise) and the
example-level DP-SGD claims its workers pushed (--dp-sgd).

Kept in ``<data dir>/privacy.json``, rewritten atomically (fsync, rename) whenever it changes. A DP step is
booked *before* its version is committed: a crash in between leaves epsilon counted one step too high, never
too low. The (epsilon, delta) figures come from ``privacy.accountant`` (Opacus's RDP accountant); a worker's
DP-SGD claim is its own statement, recorded and shown, not verified.

Under --secure-aggregation the workers add the noise (``privacy.secagg.noise``) and a cohort's step is booked
before its masks come off (``book_cohort``), at sigma sqrt(S / K) for S of its K members' inputs: the sum seen is
the release, whether or not it is then applied. The cohort's update id is remembered, so a restart that unmasks
the same cohort again books it once, and the push of its sum is told from a relay's batch (``booked``).
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from privacy.accountant import PrivacyLedger
from privacy.dp import DPFedAvgSettings, effective_noise_multiplier
from protocol.dp_cohort import DPCohortSum
from protocol.errors import Conflict, PrivacyBudgetSpent
from protocol.files import write_atomically
from protocol.schemas import UpdateMeta

LEDGER_FILE = "privacy.json"
BOOKED_KEPT = 64
"""Cohort update ids remembered per expert: only cohorts booked and not yet recorded as updates need it."""


class PrivacyLedgers:
    """Per-expert DP-FedAvg ledgers and DP-SGD claims, durable in one JSON file of the data dir."""

    def __init__(self, data_dir: Path, dp: DPFedAvgSettings | None) -> None:
        self.path = Path(data_dir) / LEDGER_FILE
        self.dp = dp
        self._lock = threading.Lock()
        saved = json.loads(self.path.read_text(encoding="utf-8")) if self.path.is_file() else {}
        self._ledgers = {name: PrivacyLedger.from_json(entry["dp_fedavg"])
                         for name, entry in saved.items() if entry.get("dp_fedavg")}
        self._claims: dict[str, dict[str, Any]] = {name: dict(entry.get("dp_sgd") or {})
                                                   for name, entry in saved.items()}
        self._booked: dict[str, list[str]] = {name: list(entry.get("cohorts_booked") or [])
                                              for name, entry in saved.items()}

    def _ledger(self, name: str) -> PrivacyLedger:
        """The expert's ledger (created on first use), its budget and delta as configured now."""
        assert self.dp is not None  # only with --dp-noise
        ledger = self._ledgers.get(name)
        if ledger is None:
            ledger = self._ledgers[name] = PrivacyLedger(delta=self.dp.delta, accountant=self.dp.accountant)
        ledger.budget, ledger.delta = self.dp.budget, self.dp.delta  # epsilon is always stated at today's delta
        return ledger

    def check_budget(self, name: str) -> None:
        """PrivacyBudgetSpent (409) if one more DP step of ``name`` would spend more than --dp-budget."""
        if self.dp is None or self.dp.budget is None:
            return
        with self._lock:
            self._check_allows(name, self.dp.noise_multiplier)

    def _check_allows(self, name: str, noise_multiplier: float) -> None:
        assert self.dp is not None
        ledger = self._ledger(name)
        if self.dp.budget is not None and not ledger.allows(noise_multiplier):
            raise PrivacyBudgetSpent(
                f"expert {name!r} has spent epsilon {ledger.epsilon():.3g} of its --dp-budget {self.dp.budget:g} "
                f"(delta {self.dp.delta:g}, {ledger.steps} DP step(s)); another step would exceed it, so no "
                "update is taken. Start a new expert, or raise --dp-budget knowingly",
                epsilon=ledger.epsilon(), budget=self.dp.budget, delta=self.dp.delta, steps=ledger.steps)

    def book_cohort(self, name: str, update_id: str, survivors: int, members: int) -> None:
        """Book a secure-aggregation cohort's step before its sum is unmasked, once per ``update_id``:
        sigma sqrt(survivors / members), the noise its survivors' shares carry (PrivacyBudgetSpent if it would
        overspend; nothing is booked then)."""
        assert self.dp is not None
        sigma = effective_noise_multiplier(self.dp.noise_multiplier, survivors, members)
        with self._lock:
            booked = self._booked.setdefault(name, [])
            if update_id in booked:
                return
            self._check_allows(name, sigma)
            self._ledger(name).record(sigma)
            booked.append(update_id)
            del booked[:-BOOKED_KEPT]
            self._save()

    def book_relay_cohort(self, name: str, claim: DPCohortSum) -> None:
        """Book a relay's DP cohort (``book_cohort``, keyed by its cohort's update id: once across retries, restarts
        and the relay's own booking before it unmasked), after checking it was noised with this root's sigma and C:
        Conflict (409 ``dp_cohort_mismatch``) if not, PrivacyBudgetSpent (409) if the budget cannot pay for it."""
        assert self.dp is not None
        if (claim.noise_multiplier, claim.clip_norm) != (self.dp.noise_multiplier, self.dp.clip_norm):
            raise Conflict(f"cohort {claim.cohort!r} of expert {name!r} was noised with sigma {claim.noise_multiplier:g} "
                           f"and clipped to C {claim.clip_norm:g}, but this coordinator runs --dp-noise "
                           f"{self.dp.noise_multiplier:g} --dp-clip {self.dp.clip_norm:g}: its step would not be the "
                           "one booked. Restart the relay so that it learns this root's settings",
                           reason="dp_cohort_mismatch", noise_multiplier=self.dp.noise_multiplier,
                           clip_norm=self.dp.clip_norm)
        self.book_cohort(name, claim.cohort, claim.survivors, claim.members)

    def booked(self, name: str, update_id: str) -> bool:
        """Whether ``update_id`` is a cohort of ``name`` booked here (its sum may be applied without another check)."""
        with self._lock:
            return update_id in self._booked.get(name, ())

    def book_step(self, name: str) -> None:
        """Record one DP step of ``name`` durably, before it is applied (PrivacyBudgetSpent if it would overspend)."""
        assert self.dp is not None
        self.check_budget(name)
        with self._lock:
            self._ledger(name).record(self.dp.noise_multiplier)
            self._save()

    def record_claim(self, name: str, worker_id: str, claim: dict[str, Any]) -> None:
        """Keep a worker's latest DP-SGD claim for ``name`` (its epsilon only grows over a run)."""
        with self._lock:
            self._claims.setdefault(name, {})[worker_id] = claim
            self._save()

    def report(self, name: str) -> dict[str, Any] | None:
        """What GET /api/v1/experts/<name> shows under "privacy"; None when nothing private happened to it."""
        with self._lock:
            out: dict[str, Any] = {}
            if self.dp is not None:
                out["dp_fedavg"] = {**self._ledger(name).report(), "noise_multiplier": self.dp.noise_multiplier,
                                    "clip_norm": self.dp.clip_norm, "sample_rate": 1.0}
            elif name in self._ledgers:  # DP was on earlier: what was spent stays spent
                out["dp_fedavg"] = {**self._ledgers[name].report(), "active": False}
            if self._claims.get(name):
                out["dp_sgd"] = {worker: {k: claim[k] for k in ("epsilon", "delta", "steps") if k in claim}
                                 for worker, claim in sorted(self._claims[name].items())}
            return out or None

    def _save(self) -> None:
        names = sorted(set(self._ledgers) | set(self._claims))
        data = {name: {"dp_fedavg": self._ledgers[name].to_json() if name in self._ledgers else None,
                       "dp_sgd": self._claims.get(name) or {},
                       **({"cohorts_booked": self._booked[name]} if self._booked.get(name) else {})} for name in names}
        write_atomically(self.path, (json.dumps(data, indent=1) + "\n").encode())

    def admit_update(self, name: str, meta: UpdateMeta, secure_aggregation: bool) -> None:
        """A push under --dp-noise (``secure_aggregation``: the root runs that too): 409 once the expert's
        --dp-budget is spent; a relay's combined update of several workers is refused, since clipping it as one
        contribution would let each of its workers move the step by up to 2C. A relay batch of one worker's
        update, naming that worker, is that worker's contribution (relays learn that this root runs DP and
        forward so), unless this root runs --secure-aggregation: its steps then clip nothing, and a relay's
        batch must be one of its DP cohorts' sums (``dp_cohort``), booked here before it is applied."""
        if self.dp is None:
            return
        if meta.members and self.booked(name, meta.update_id):
            return  # this coordinator's own secure-aggregation cohort, booked before its masks came off
        if meta.dp_cohort is not None and secure_aggregation:
            if set(meta.members or ()) != {meta.dp_cohort.cohort}:
                raise Conflict(f"a DP cohort's sum for expert {name!r} carries exactly one member, its cohort "
                               f"{meta.dp_cohort.cohort!r}; got {sorted(meta.members or ())[:4]}",
                               reason="dp_relay_batch")
            self.book_relay_cohort(name, meta.dp_cohort)  # 409: sigma or C not ours, or the budget spent
            return
        if meta.dp_cohort is not None:
            raise Conflict(f"expert {name!r} is trained with --dp-noise without --secure-aggregation here: this "
                           "coordinator clips and noises each worker's update itself and takes no cohort's sum; start "
                           "the relay without --secure-aggregation (it then forwards each worker's update)",
                           reason="dp_relay_batch")
        if secure_aggregation and meta.members:
            raise Conflict(f"expert {name!r} is trained with worker-level differential privacy under secure "
                           "aggregation: this coordinator clips and noises nothing itself, so a relay's batch must be "
                           "the sum of one of its DP cohorts; start the relay with --secure-aggregation as well",
                           reason="dp_relay_batch")
        if meta.members and not (len(meta.members) == 1 and meta.worker_id):
            raise Conflict(f"expert {name!r} is trained with worker-level differential privacy (--dp-noise): a "
                           "relay's combined update cannot be clipped per worker; connect these workers to this "
                           "coordinator directly", reason="dp_relay_batch")
        self.check_budget(name)
