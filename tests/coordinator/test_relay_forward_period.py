"""The relay's forward loop keeps its period: a cycle every --forward-interval from the start of the one
before, back to back when a cycle takes longer (a fake clock; no real waiting)."""
from __future__ import annotations

import threading

import pytest

from coordinator.relay.forwarder import Forwarder, ForwardPolicy


class FakeWake:
    """threading.Event's wait/set/clear on a fake clock: wait(t) advances the clock by t and records t."""

    def __init__(self, clock: list[float]) -> None:
        self.clock, self.waits = clock, []

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.clock[0] += timeout
        return False

    def set(self) -> None:
        pass

    def clear(self) -> None:
        pass


def loop_waits(interval: float, cycle: float, cycles: int = 4) -> list[float]:
    """The waits of the forward loop whose every cycle takes ``cycle`` seconds of the fake clock."""
    clock = [100.0]
    forwarder = Forwarder.__new__(Forwarder)  # the loop alone: no store, blobs or upstream
    forwarder.policy = ForwardPolicy(interval=interval)
    forwarder._stop, forwarder._wake, forwarder._clock = threading.Event(), FakeWake(clock), lambda: clock[0]
    done = []

    def forward_once() -> int:
        clock[0] += cycle
        done.append(clock[0])
        if len(done) == cycles:
            forwarder._stop.set()
        return 0

    forwarder.forward_once = forward_once  # type: ignore[method-assign]
    forwarder._loop()
    assert len(done) == cycles
    return forwarder._wake.waits


@pytest.mark.parametrize("cycle, waits", [
    (3.0, [10.0, 7.0, 7.0, 7.0]),  # a short cycle: the rest of the interval, so one cycle every 10 s
    (25.0, [10.0, 0.0, 0.0, 0.0]),  # longer than the interval: back to back, not 10 s after each (35 s)
    (0.0, [10.0, 10.0, 10.0, 10.0]),
])
def test_cycles_start_an_interval_apart_not_an_interval_after_the_last_ended(cycle, waits):
    assert loop_waits(10.0, cycle) == pytest.approx(waits)
