"""--min-dp-noise: a worker's own floor on the worker-level differential privacy its updates get.

A team whose data may only leave under differential privacy should not have to trust that the coordinator was
started with ``--dp-noise``. With ``--min-dp-noise SIGMA`` the worker checks what the coordinator announces before
anything leaves: at joining, the expert's ``privacy.dp_fedavg`` (its noise multiplier, and that it is active); under
``--secure-aggregation``, each cohort's DP config too, where the worker itself adds the noise (a cohort below the
floor is refused before this worker posts its keys, so its updates stay queued). It checks announcements: a
coordinator that lies about its sigma is outside what this can catch (docs/privacy.md, "What it trusts"); DP-SGD
(``--dp-sgd``) is the protection a worker draws itself.
"""
from __future__ import annotations

from typing import Any

from worker.errors import WorkerError


class PrivacyFloorError(WorkerError):
    """The coordinator does not announce the worker-level DP this worker's --min-dp-noise asks for."""


def announced_noise(info: dict[str, Any]) -> float | None:
    """The noise multiplier the coordinator applies to this expert's steps now (GET /api/v1/experts/<name>), or
    None when it adds none (no --dp-noise, or DP switched off since). A relay answers with its root's."""
    dp = (info.get("privacy") or {}).get("dp_fedavg")
    if not isinstance(dp, dict) or dp.get("active") is False:
        return None
    sigma = dp.get("noise_multiplier")
    return float(sigma) if isinstance(sigma, (int, float)) and not isinstance(sigma, bool) else None


def check_expert(name: str, info: dict[str, Any], floor: float | None) -> None:
    """Raise PrivacyFloorError unless the expert's coordinator announces a noise multiplier of at least ``floor``."""
    if floor is None:
        return
    sigma = announced_noise(info)
    if sigma is None:
        raise PrivacyFloorError(
            f"expert {name!r}: this worker was started with --min-dp-noise {floor:g}, but its coordinator adds no "
            "worker-level differential privacy noise (start it with --dp-noise and --dp-clip, or drop --min-dp-noise); "
            "nothing was pushed")
    if sigma < floor:
        raise PrivacyFloorError(
            f"expert {name!r}: its coordinator adds DP noise of multiplier {sigma:g}, below this worker's "
            f"--min-dp-noise {floor:g}; nothing was pushed")


def cohort_below_floor(sigma: float | None, floor: float | None) -> str | None:
    """Why a secure-aggregation cohort with DP noise multiplier ``sigma`` (None: no DP) is below ``floor``; None if
    it is not."""
    if floor is None:
        return None
    if sigma is None:
        return f"the cohort adds no DP noise and this worker's --min-dp-noise is {floor:g}"
    if sigma < floor:
        return f"the cohort's DP noise multiplier {sigma:g} is below this worker's --min-dp-noise {floor:g}"
    return None
