"""A relay's secure-aggregation cohorts under its root's DP-FedAvg (docs/privacy.md, "Relays").

When the root runs ``--dp-noise`` with ``--secure-aggregation`` it tells a joining relay its sigma and C
(``limits`` in the join answer). The relay's cohorts are then DP cohorts exactly as the root's are: every member is
told sigma and C in its cohort config, clips its update to C and adds N(0, sigma^2 C^2 / K) before masking, and
checks the config as it would a root's (``--min-dp-noise`` included). Before the relay removes a cohort's masks it
has the root book the cohort's step (``POST /api/v1/experts/<name>/dp-cohorts``: one Gaussian step of sensitivity C
at sigma sqrt(S / K), once per cohort), because the unmasked sum, which the relay sees, is the release. A cohort the
root will not book (its budget is spent, or its sigma and C changed) is abandoned unopened: its members keep their
deltas, nothing is lost; an unreachable root leaves the cohort masked until it answers. The sum then goes upstream as
a batch of its own, marked ``dp_cohort`` (protocol/dp_cohort.py), and the root applies it as one step.

Combinations that cannot work stop the relay at start with one line (``cohort_noise``).
"""
from __future__ import annotations

import logging
import threading

from coordinator.checks.update_limits import UpdateLimits
from coordinator.cohorts import Booking, dp_cohort_sum
from coordinator.relay.upstream import RelayStartError, UpstreamClient
from privacy.secagg.aggregator import ReleaseDeferred
from privacy.secagg.config import CohortConfig
from privacy.secagg.noise import CohortNoise
from protocol.errors import BadRequest, Conflict, FedMoEError, NotFound, PrivacyBudgetSpent, Unavailable

log = logging.getLogger(__name__)


def cohort_noise(limits: UpdateLimits, secure_aggregation: bool) -> CohortNoise | None:
    """The sigma and C this relay's cohorts carry under ``limits`` (None: no DP cohorts); RelayStartError for a relay
    whose --secure-aggregation does not match what its DP root can take."""
    if not limits.dp:
        return None
    if limits.secure_aggregation and not secure_aggregation:
        raise RelayStartError("the upstream trains with --dp-noise under --secure-aggregation: it clips and noises "
                              "nothing itself, so it takes only DP cohorts' sums from a relay; start this relay with "
                              "--secure-aggregation as well")
    if not secure_aggregation:
        return None  # the root clips each worker's update: the forwarder sends them one by one
    if not limits.secure_aggregation:
        raise RelayStartError("the upstream trains with --dp-noise without --secure-aggregation: it clips each "
                              "worker's update itself and takes no cohort's sum; start this relay without "
                              "--secure-aggregation")
    if limits.noise_multiplier is None or limits.clip_norm is None:
        raise RelayStartError("the upstream runs DP with secure aggregation but did not announce its sigma and C (an "
                              "older release): upgrade it, or start this relay without --secure-aggregation")
    return CohortNoise(limits.noise_multiplier, limits.clip_norm)


class SpentBudgets:
    """Experts whose privacy budget the root said is spent (it refused a booking so), in memory.

    The cohort routes ask ``check_budget`` before a worker joins a cohort, as the root's own ledgers are asked: a
    cohort formed now could never be booked, so the join is refused (409 privacy_budget_spent) instead of rounds
    of cohorts each abandoned at booking. A spent budget does not come back (docs/privacy.md, "Budget"); a relay
    restarted learns it again from its first refused booking."""

    def __init__(self) -> None:
        self._spent: dict[str, str] = {}
        self._lock = threading.Lock()

    def spent(self, expert: str, message: str) -> None:
        with self._lock:
            self._spent[expert] = message

    def check_budget(self, expert: str) -> None:
        with self._lock:
            message = self._spent.get(expert)
        if message is not None:
            raise PrivacyBudgetSpent(f"expert {expert!r}: the root refused its last DP cohort: {message}")


def upstream_booking(upstream: UpstreamClient, budgets: SpentBudgets | None = None) -> Booking:
    """Book each DP cohort's step at the root before this relay unmasks it (see the module's docstring); a refusal
    as spent is remembered in ``budgets``."""

    def book(config: CohortConfig, survivors: int) -> str | None:
        claim = dp_cohort_sum(config, survivors)
        if claim is None:
            return None
        try:
            upstream.transport.json("POST", f"/experts/{config.expert}/dp-cohorts", json=claim.to_json())
        except (Conflict, NotFound, BadRequest) as exc:  # budget spent, sigma or C changed, expert gone: never
            if isinstance(exc, PrivacyBudgetSpent) and budgets is not None:
                budgets.spent(config.expert, exc.message)
            log.error("cohort %s of %s abandoned unopened: the root refused to book its DP step: %s",
                      config.cohort_id, config.expert, exc.message)
            return f"the root refused to book its DP step ({exc.code}): {exc.message}"
        except (Unavailable, FedMoEError) as exc:  # unreachable, or refused the request (a token, a rate limit)
            raise ReleaseDeferred(f"the root could not book its DP step yet ({exc})") from None
        return None

    return book
