"""The worker console: a bar only on terminals (or when asked), and exactly one log line per sync."""
import io
import json
import logging

from protocol.logs import JsonFormatter
from worker.console import SyncConsole, sync_line
from worker.sync_state import IntervalStats

RECORD = {"time": 0.0, "sync": 3, "final": False, "worker_id": "w", "base_version": 7, "steps": 12, "samples": 96,
          "tokens": 6000, "train_loss": 2.34567, "train_seconds": 2.0, "bytes_sent": 123_456, "ratio": 7.95,
          "delivered": True, "pulled": True, "bytes_down": 2_500_000, "version": 9, "outbox": 0,
          "sync_seconds": 0.1234}


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def interval(steps: int) -> IntervalStats:
    stats = IntervalStats()
    stats.steps, stats.tokens, stats.seconds, stats.loss_sum = steps, 500 * steps, 0.1 * steps, 2.5 * steps
    return stats


def test_sync_line_says_what_was_trained_sent_and_pulled():
    assert sync_line(RECORD) == ("sync 3: 12 steps, loss 2.3457, 3000 tokens/s; sent 123.46 kB (compression 7.95x); "
                                 "pulled v9 (2.50 MB); sync took 0.12 s")
    offline = RECORD | {"delivered": False, "pulled": False, "outbox": 2}
    assert "coordinator unreachable, 2 update(s) queued" in sync_line(offline)
    idle = {"sync": 0, "final": True, "delivered": True, "pulled": False, "sync_seconds": 0.01}
    assert sync_line(idle) == "sync 0 (final): nothing trained; sync took 0.01 s"


def test_with_speed_factor_tokens_per_second_counts_the_sleep_and_says_the_compute_rate():
    slowed = RECORD | {"throttle_seconds": 2.0}  # --speed-factor 0.5: slept as long as the 2 s of steps took
    assert "12 steps, loss 2.3457, 1500 tokens/s (3000 computing, --speed-factor sleeps excluded);" in sync_line(slowed)
    stats = interval(4)
    stats.throttled = 0.4
    assert stats.tokens_per_second == 2500  # the bar shows the same effective rate


def test_the_final_flush_is_named():
    flush = RECORD | {"final": True, "ratio": 1.0, "flushed_residual_norm": 3.2}
    assert "sent 123.46 kB (compression 1x, the final flush with the residual);" in sync_line(flush)


def test_no_bar_on_a_pipe_but_one_line_per_sync(caplog):
    stream = io.StringIO()  # not a terminal, like a log file under systemd
    console = SyncConsole(10.0, stream=stream)
    with caplog.at_level(logging.INFO, logger="worker.sync"):
        for sync in range(2):
            for steps in range(1, 50):
                console.on_train_chunk(interval(steps))
            console.on_sync(RECORD | {"sync": sync})
    assert stream.getvalue() == ""
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["sync 0", "sync 1"]
    assert caplog.records[0].sync_record["bytes_sent"] == RECORD["bytes_sent"]


def test_bar_on_a_terminal_shows_steps_loss_and_speed_then_clears():
    stream = FakeTty()
    console = SyncConsole(10.0, stream=stream, redraw_seconds=0)
    console.on_train_chunk(interval(4))
    console.on_sync(RECORD)
    drawn = stream.getvalue()
    assert "sync 0" in drawn and "4 steps, loss 2.5000, 5000 tokens/s" in drawn
    console.on_train_chunk(interval(1))
    assert "sync 4" in stream.getvalue()  # the next bar is numbered after the sync that closed the last one


def test_json_log_line_carries_the_whole_record():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("worker.sync")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        SyncConsole(10.0, progress=False, stream=io.StringIO()).on_sync(RECORD)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    entry = json.loads(stream.getvalue())
    assert entry["logger"] == "worker.sync" and entry["message"].startswith("sync 3: 12 steps")
    assert entry["sync_record"] == RECORD
