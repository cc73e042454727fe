"""DP-FedAvg's clipping and noise: exact norms, the noise's scale (fixed seeds), per-worker contributions."""
from __future__ import annotations

import math

import pytest
import torch

from privacy.accountant import PrivacyError
from privacy.dp import (DPFedAvgSettings, clip_update, dp_fedavg_step, noise_generator, update_norm,
                        worker_contributions)

SHAPES = {"a": (64, 32), "b": (16, 64)}


def delta_of(norm: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    raw = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    return {k: v * (norm / update_norm(raw)) for k, v in raw.items()}


def test_clip_scales_the_whole_update_to_the_norm_and_leaves_small_ones_alone():
    big = delta_of(10.0, 0)
    clipped, norm = clip_update(big, 2.0)
    assert norm == pytest.approx(10.0)
    assert update_norm(clipped) == pytest.approx(2.0, rel=1e-6)
    assert torch.allclose(clipped["a"], big["a"] * 0.2)  # one scale for every tensor: the direction is kept
    small = delta_of(1.5, 1)
    same, _ = clip_update(small, 2.0)
    assert all(torch.equal(same[k], small[k]) for k in SHAPES)


def test_step_without_noise_is_the_mean_of_clipped_contributions_over_the_fixed_size():
    # a noise multiplier this small leaves the arithmetic visible (the noise is ~1e-9 per coordinate)
    settings = DPFedAvgSettings(clip_norm=1.0, noise_multiplier=1e-9)
    contributions = [delta_of(5.0, 2), delta_of(0.5, 3)]
    current = {k: torch.zeros(s) for k, s in SHAPES.items()}
    report = dp_fedavg_step(current, contributions, settings, denominator=4, server_lr=2.0,
                            generator=noise_generator(0))
    expected = {k: 2.0 * (contributions[0][k] / 5.0 + contributions[1][k]) / 4 for k in SHAPES}
    assert all(torch.allclose(current[k], expected[k], atol=1e-6) for k in SHAPES)
    assert report.clipped == 1 and report.norms == pytest.approx((5.0, 0.5))


def test_step_noise_has_std_sigma_c_over_the_denominator():
    """A statistical test with a fixed seed: 3,072 coordinates of pure noise (no contribution)."""
    settings = DPFedAvgSettings(clip_norm=0.5, noise_multiplier=3.0)
    current = {k: torch.zeros(s) for k, s in SHAPES.items()}
    dp_fedavg_step(current, [], settings, denominator=4, server_lr=1.0, generator=noise_generator(7))
    values = torch.cat([v.flatten() for v in current.values()])
    expected = 3.0 * 0.5 / 4
    # the sample std of n normals has relative standard error ~ 1 / sqrt(2n) = 1.3%: 5% is ~4 standard errors
    assert values.std().item() == pytest.approx(expected, rel=0.05)
    assert abs(values.mean().item()) < 4 * expected / math.sqrt(values.numel())


def test_one_workers_pushes_in_one_step_are_one_contribution():
    first, second, other = delta_of(1.0, 5), delta_of(1.0, 6), delta_of(1.0, 7)
    grouped = worker_contributions([("w1", first), ("w2", other), ("w1", second)])
    assert len(grouped) == 2
    assert torch.allclose(grouped[0]["a"], first["a"] + second["a"])
    assert torch.equal(grouped[1]["b"], other["b"])


def test_noise_generator_without_a_seed_differs_between_draws():
    assert not torch.equal(torch.randn(8, generator=noise_generator()), torch.randn(8, generator=noise_generator()))


@pytest.mark.parametrize("kwargs", [{"clip_norm": 0.0, "noise_multiplier": 1.0},
                                    {"clip_norm": 1.0, "noise_multiplier": -1.0},
                                    {"clip_norm": 1.0, "noise_multiplier": 1.0, "delta": 1.0},
                                    {"clip_norm": 1.0, "noise_multiplier": 1.0, "budget": 0.0}])
def test_bad_settings_name_the_flag(kwargs):
    with pytest.raises(PrivacyError, match="--dp-|delta"):
        DPFedAvgSettings(**kwargs)


def test_more_contributions_than_the_fixed_size_is_refused():
    settings = DPFedAvgSettings(clip_norm=1.0, noise_multiplier=1.0)
    current = {k: torch.zeros(s) for k, s in SHAPES.items()}
    with pytest.raises(PrivacyError, match="fixed size"):
        dp_fedavg_step(current, [delta_of(1.0, 0)] * 3, settings, 2, 1.0, noise_generator(0))
