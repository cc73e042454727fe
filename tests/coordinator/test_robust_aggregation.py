"""Robust rules for buffered rounds and the norm check, on hand-computed values."""
from __future__ import annotations

import pytest
import torch

from coordinator.aggregation import AggregationParams, Update, l2_norm
from coordinator.aggregation.robust import ROBUST_RULES, RobustParams, robust_aggregator, trim_count
from coordinator.config import CoordinatorConfig
from coordinator.checks.norm_check import NormPolicy, judge_norm
from protocol.errors import InvalidUpdate


def buffer(*values: list[float], staleness: tuple[int, ...] | None = None,
           samples: tuple[int, ...] | None = None) -> list[Update]:
    n = len(values)
    return [Update({"w": torch.tensor(v)}, (samples or (1,) * n)[i], (staleness or (0,) * n)[i])
            for i, v in enumerate(values)]


def step(rule: str, updates: list[Update], trim: float = 0.2, lr: float = 1.0, decay: float = 0.0) -> list[float]:
    out = robust_aggregator(rule, trim)({"w": torch.zeros(len(updates[0].delta["w"]))}, updates,
                                        AggregationParams(server_lr=lr, staleness_decay=decay))
    return out["w"].tolist()


def test_median_odd_and_even_counts():
    assert step("median", buffer([1, 10], [2, -5], [100, 0])) == [2, 0]
    assert step("median", buffer([1.0], [2.0], [4.0], [1e6])) == [3.0]  # mean of the two middle values


def test_trimmed_mean_drops_k_at_each_end():
    # 5 updates, trim 0.2 -> k = 1: drop 1e6 and -1e6, mean of 1, 2, 3
    assert step("trimmed_mean", buffer([1.0], [2.0], [1e6], [3.0], [-1e6])) == [2.0]
    assert trim_count(5, 0.2) == 1 and trim_count(10, 0.25) == 2 and trim_count(3, 0.45) == 1
    assert trim_count(4, 0.49) == 1  # always leaves at least one value... and here two


def test_clip_bounds_a_large_update_to_the_median_norm():
    # norms 1, 2, 3, 100; the limit is the lower median, 2: [3, 0] -> [2, 0], [0, -100] -> [0, -2]
    updates = buffer([1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, -100.0])
    got = step("clip", updates)
    assert got == pytest.approx([(1 + 2) / 4, (2 - 2) / 4])
    assert l2_norm({"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([12.0])}) == pytest.approx(13.0)


def test_staleness_shrinks_an_update_before_the_statistic_and_server_lr_scales_the_result():
    # decay 1: staleness 1 halves [4] to [2]; median of 1, 2, 3 is 2; server_lr 0.5 -> 1
    assert step("median", buffer([1.0], [4.0], [3.0], staleness=(0, 1, 0)), lr=0.5, decay=1.0) == [1.0]


def test_median_and_trimmed_mean_ignore_claimed_sample_counts():
    updates = buffer([1.0], [2.0], [1e6], samples=(1, 1, 10**9))
    assert step("median", updates) == [2.0]
    assert step("trimmed_mean", updates, trim=0.34) == [2.0]


def test_current_weights_are_not_modified():
    current = {"w": torch.tensor([1.0, 1.0])}
    new = robust_aggregator("median")(current, buffer([1, 1], [2, 2], [3, 3]), AggregationParams())
    assert current["w"].tolist() == [1.0, 1.0] and new["w"].tolist() == [3.0, 3.0]


def test_robust_params_check_the_fraction():
    with pytest.raises(ValueError, match="trim_fraction"):
        RobustParams(0.5)
    assert set(ROBUST_RULES) == {"clip", "median", "trimmed_mean"}


# norm check -------------------------------------------------------------------------------------

POLICY = NormPolicy(mode="reject", factor=3.0, history=20, warmup=3)


def test_norm_check_passes_everything_during_warmup_and_when_off():
    assert judge_norm(1e9, [1.0, 1.0], POLICY).limit is None
    assert judge_norm(1e9, [1.0] * 10, NormPolicy(mode="off")).scale == 1.0


def test_norm_check_limit_is_factor_times_the_median():
    verdict = judge_norm(5.0, [1.0, 2.0, 100.0], POLICY)  # median 2 (the outlier does not move it)
    assert verdict.limit == 6.0 and verdict.scale == 1.0 and not verdict.clipped


def test_norm_check_rejects_with_the_numbers():
    with pytest.raises(InvalidUpdate, match="--norm-factor") as info:
        judge_norm(7.0, [1.0, 2.0, 3.0], POLICY)
    assert info.value.status == 422
    assert info.value.details == {"reason": "norm_too_large", "norm": 7.0, "limit": 6.0, "history": 3}


def test_norm_check_clip_scales_to_the_limit():
    verdict = judge_norm(12.0, [2.0, 2.0, 2.0], NormPolicy(mode="clip", factor=3.0, warmup=3))
    assert verdict.clipped and verdict.scale == 0.5 and verdict.accepted_norm == 6.0


@pytest.mark.parametrize("overrides, flag", [
    ({"norm_check": "strict"}, "--norm-check"),
    ({"norm_factor": 1.0}, "--norm-factor"),
    ({"norm_history": 0}, "--norm-history"),
    ({"norm_warmup": 30}, "--norm-warmup"),
    ({"robust": "krum"}, "--robust"),
    ({"robust": "median"}, "--aggregation fedbuff"),
    ({"robust": "median", "aggregation": "fedbuff", "buffer_size": 2}, "--buffer-size >= 3"),
    ({"robust": "trimmed_mean", "aggregation": "fedbuff", "buffer_size": 4, "trim_fraction": 0.2},
     "use at least 0.25"),
    ({"trim_fraction": 0.5}, "--trim-fraction"),
])
def test_config_errors_name_the_flag(tmp_path, overrides, flag):
    with pytest.raises(ValueError, match=flag.replace("+", r"\+")):
        CoordinatorConfig(data_dir=tmp_path, **overrides)
