"""bench.converge and bench.flower_baseline without a model: what they score, on which data, with which settings.
The runs themselves (real workers, Flower's simulation) are the benchmark's: `python -m bench.converge --quick`."""
from __future__ import annotations

import json

import pytest
import torch

from bench import converge
from bench.flower_baseline import BaselineSettings, _optimizer_state


def test_scored_versions_count_every_workers_steps_and_keep_first_and_last():
    versions = [{"version": 0, "samples": 0}] + [{"version": v, "samples": 8} for v in range(1, 10)]
    picked = converge.scored_versions(versions, limit=4, batch_size=4)
    assert [(p["version"], p["steps"]) for p in picked] == [(0, 0), (3, 6), (6, 12), (9, 18)]
    assert len(converge.scored_versions(versions, limit=20, batch_size=4)) == 10  # all, when few


def test_shards_are_disjoint_and_cover_the_library(tmp_path):
    paths = converge.write_shards("sklearn_expert", 3, tmp_path)
    rows = [[json.loads(line)["prompt"] for line in p.read_text().splitlines()] for p in paths]
    shipped = (converge.ROOT / "data" / "ds1000" / "train" / "sklearn_expert.jsonl").read_text().splitlines()
    assert sum(len(r) for r in rows) == len(shipped) and len({p for r in rows for p in r}) == len(shipped)
    assert [len(r) for r in rows] == [34, 34, 33]


def test_the_final_loss_is_compared_with_fedavgs_and_any_rise_above_the_base_is_flagged():
    curve = converge.Curve("original", 3, [{"steps": 0, "loss": 1.8}, {"steps": 6, "loss": 2.3},
                                           {"steps": 18, "loss": 1.7}], wall_seconds=10.0, versions=9)
    row = curve.summary(base=1.8, reference=1.6)
    assert (row["highest"], row["final"], row["rose_above_base"]) == (2.3, 1.7, True)
    assert row["final_vs_fedavg"] == pytest.approx(0.1) and row["final_steps"] == 18


def test_missing_flower_venv_is_one_line_that_says_how_to_install_it(tmp_path):
    problem = converge.check_flower(tmp_path / "nope" / "python")
    assert problem is not None and "requirements-bench.txt" in problem


def test_flower_settings_round_trip_through_a_run_config_and_refuse_unknown_keys():
    settings = BaselineSettings(shards="/s", out="/o", clients=6, local_steps=2, lr=5e-4)
    assert BaselineSettings.from_config(settings.as_config()) == settings
    assert BaselineSettings.from_config({"local-steps": "4", "clients": 2}).local_steps == 4
    with pytest.raises(ValueError, match="unknown setting 'local_step'"):
        BaselineSettings.from_config({"local_step": 4})


def test_a_clients_adamw_moments_go_back_into_its_optimizer_by_parameter():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    kept = {f"{i}.{k}": v.clone() for i, state in optimizer.state_dict()["state"].items() for k, v in state.items()}

    class Trainer:  # what _optimizer_state needs: the trainer's own (fresh) optimizer state
        def optimizer_state(self):
            return torch.optim.AdamW(torch.nn.Linear(3, 2).parameters()).state_dict()

    restored = _optimizer_state(Trainer(), kept)
    assert set(restored["state"]) == {0, 1}
    assert torch.equal(restored["state"][1]["exp_avg"], optimizer.state_dict()["state"][1]["exp_avg"])
