"""The accountant's epsilon against published figures and a closed form, and the ledger's budget."""
from __future__ import annotations

import math

import pytest

from privacy.accountant import (GaussianSteps, PrivacyError, PrivacyLedger, epsilon_spent,
                                noise_multiplier_for)


def test_epsilon_matches_opacus_documented_example():
    """Opacus's own accountant test (opacus/tests/accountants_test.py): sigma 1.5, q 0.04, 90 epochs, delta 1e-5."""
    assert epsilon_spent([GaussianSteps(1.5, 0.04, int(90 / 0.04))], 1e-5) == pytest.approx(7.32911117143, abs=1e-6)


def test_epsilon_is_within_abadi_et_al_moments_accountant_figure():
    """Abadi et al. 2016, section 3.1: q = 0.01, sigma = 4, T = 10,000, delta = 1e-5 gives epsilon ~ 1.26 with the
    moments accountant (9.34 with the strong composition theorem). RDP with the conversion of Balle et al. 2020 is
    a tighter bound on the same mechanism: below 1.26, and not absurdly so."""
    eps = epsilon_spent([GaussianSteps(4.0, 0.01, 10_000)], 1e-5)
    assert 0.9 < eps < 1.26


def test_unsampled_gaussian_matches_the_closed_form_rdp_bound():
    """q = 1 (DP-FedAvg without sampling): T Gaussian mechanisms have RDP T * alpha / (2 sigma^2) at every order
    (Mironov 2017, Prop. 7); epsilon is at most its minimum over alpha of the classic conversion
    eps + log(1/delta) / (alpha - 1), and the improved conversion Opacus uses gains at most log(alpha) / (alpha-1)."""
    sigma, steps, delta = 3.0, 20, 1e-5
    orders = [1 + x / 10 for x in range(1, 1000)]
    classic = min(steps * a / (2 * sigma**2) + math.log(1 / delta) / (a - 1) for a in orders)
    eps = epsilon_spent([GaussianSteps(sigma, 1.0, steps)], delta)
    assert eps <= classic + 1e-9
    assert eps > 0.8 * classic


def test_noise_multiplier_for_meets_the_target_epsilon():
    sigma = noise_multiplier_for(2.0, 1e-5, steps=100, sample_rate=0.04)
    assert epsilon_spent([GaussianSteps(sigma, 0.04, 100)], 1e-5) <= 2.0
    assert epsilon_spent([GaussianSteps(sigma * 0.97, 0.04, 100)], 1e-5) > 2.0  # and not much more noise than needed


def test_ledger_refuses_the_step_past_its_budget_and_round_trips():
    sigma = noise_multiplier_for(4.0, 1e-5, steps=3)
    ledger = PrivacyLedger(delta=1e-5, budget=4.0)
    for _ in range(3):
        assert ledger.allows(sigma)
        ledger.record(sigma)
    assert ledger.steps == 3 and ledger.epsilon() <= 4.0
    assert not ledger.allows(sigma)
    again = PrivacyLedger.from_json(ledger.to_json())
    assert again.epsilon() == ledger.epsilon() and again.history == [GaussianSteps(sigma, 1.0, 3)]


def test_ledger_keeps_segments_when_the_noise_changes():
    ledger = PrivacyLedger(delta=1e-5)
    ledger.record(2.0)
    ledger.record(2.0)
    ledger.record(1.0)
    assert ledger.history == [GaussianSteps(2.0, 1.0, 2), GaussianSteps(1.0, 1.0, 1)]
    assert ledger.epsilon() == epsilon_spent([GaussianSteps(2.0, 1.0, 2), GaussianSteps(1.0, 1.0, 1)], 1e-5)
    assert PrivacyLedger(delta=1e-5).epsilon() == 0.0


@pytest.mark.parametrize("make", [lambda: GaussianSteps(0.0, 1.0, 1), lambda: GaussianSteps(1.0, 1.5, 1),
                                  lambda: PrivacyLedger(delta=0.0), lambda: PrivacyLedger(delta=1e-5, budget=-1),
                                  lambda: PrivacyLedger(delta=1e-5, accountant="moments")])
def test_bad_settings_are_refused_with_a_privacy_error(make):
    with pytest.raises(PrivacyError):
        make()
