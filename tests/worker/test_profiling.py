"""worker.profiling (--profile) on two gloo ranks and its interval maths; worker.tensorboard_log (--tensorboard)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.worker import strategy_ranks
from tests.worker.conftest import spawn_ranks
from tests.worker.test_strategies import free_port
from worker.profiling import STEP_LABEL, ProfileSettings, describe, intersect, length, summarize, union


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    spawn_ranks(strategy_ranks.profile_main, free_port(), str(out))
    return out


@pytest.mark.slow  # two torch ranks spawned (mp.spawn)
@pytest.mark.parametrize("strategy, collective", [("ddp", "all_reduce"), ("fsdp", "all_gather")])
def test_every_rank_writes_a_trace_and_the_collective_share_of_its_steps(profiled, strategy, collective):
    for rank in range(2):
        trace = json.loads((profiled / strategy / f"rank{rank}-trace.json").read_text())
        assert sum(e.get("name") == STEP_LABEL for e in trace["traceEvents"]) == 2  # only the profiled steps
        summary = json.loads((profiled / strategy / f"rank{rank}-summary.json").read_text())
        assert summary["steps"] == 2 and summary["step_ms"] > 0
        share = summary["collectives"][collective]
        assert 0 < share["share_of_step"] < 1 and 0 <= share["overlapped_compute"] <= 1
        assert share["ms"] <= summary["step_ms"]
    assert not list((profiled / strategy).glob(".*partial"))


def event(name, start, end, thread):
    return SimpleNamespace(name=name, thread=thread, time_range=SimpleNamespace(start=start, end=end))


def test_summary_measures_shares_and_overlap_from_the_events():
    events = [
        event(STEP_LABEL, 0, 100, thread=1), event(STEP_LABEL, 200, 300, thread=1),
        event("aten::mm", 10, 40, thread=1), event("aten::mm", 210, 250, thread=1),
        event("gloo:all_reduce", 30, 60, thread=7),   # 10 of its 30 us overlap the first mm
        event("gloo:all_reduce", 240, 260, thread=8),  # 10 of 20 overlap the second
        event("gloo:all_gather", 150, 170, thread=7),  # between steps: not step time
        event("c10d::allreduce_", 30, 31, thread=1),  # the training thread's call, not the transfer
    ]
    summary = summarize(events)
    assert summary["steps"] == 2 and summary["step_ms"] == 0.2
    assert summary["collectives"] == {"all_reduce": {"ms": 0.05, "share_of_step": 0.25, "overlapped_compute": 0.4}}
    assert describe(summary) == "2 steps, 0 ms/step; all_reduce 25% of step time (40% overlapped compute)"


def test_interval_maths():
    assert union([(5, 7), (0, 2), (1, 3)]) == [(0, 3), (5, 7)]
    assert intersect([(0, 10)], [(2, 3), (5, 12)]) == [(2, 3), (5, 10)]
    assert length(intersect([(0, 1)], [(1, 2)])) == 0
    with pytest.raises(ValueError, match="--profile-steps must be at least 1, got 0"):
        ProfileSettings(directory=".", steps=0)


def test_tensorboard_gets_the_step_and_sync_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from worker.tensorboard_log import TensorBoardLog

    board = TensorBoardLog(tmp_path)
    board.step({"step": 1, "loss": 2.5, "tokens_per_s": 100.0, "ratio": None, "strategy": "ddp"})
    board.step({"step": 2, "loss": 2.0, "tokens_per_s": 120.0, "bytes_sent": 64})
    board.sync({"sync": 0, "train_loss": 2.2, "bytes_sent": 1000, "final": False})
    board.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars == {"step/loss": [(1, 2.5), (2, 2.0)], "step/tokens_per_s": [(1, 100.0), (2, 120.0)],
                       "step/bytes_sent": [(2, 64.0)], "sync/train_loss": [(0, pytest.approx(2.2))],
                       "sync/bytes_sent": [(0, 1000.0)]}


def test_run_worker_profile_and_tensorboard_flags(capsys):
    import run_worker

    config = run_worker.build_config(run_worker.parse_args(
        ["--specialty", "sql_expert", "--profile", "prof", "--profile-steps", "5", "--tensorboard", "tb"]))
    assert (config.profile.directory.name, config.profile.steps, config.tensorboard.name) == ("prof", 5, "tb")
    code = run_worker.main(["--specialty", "sql_expert", "--profile-steps", "5", "--coordinator-url",
                            "http://127.0.0.1:9"])
    assert code == 2 and "error: --profile-steps given without --profile DIR" in capsys.readouterr().err
