"""The relay's forward loop: at most one cycle with work per --forward-interval, counted from the start of the
one before (back to back when a cycle takes longer), and at once when an update reaches an idle relay; without
work, a report cycle every interval. A fake clock and store: no real waiting."""
from __future__ import annotations

import threading

import pytest

from coordinator.relay.forwarder import Forwarder, ForwardPolicy


class FakeRelay:
    """A fake clock, a queue of worker updates arriving at given times, and the wake event the loop waits on.

    ``wait(timeout)`` advances the clock to the next arrival if one comes first (the service's ``notify``
    wakes the loop), else by ``timeout``."""

    def __init__(self, arrivals: list[float], always_work: bool, until: float) -> None:
        self.clock, self.arrivals, self.always_work, self.until = 0.0, sorted(arrivals), always_work, until
        self.queued = 0
        self.stop = threading.Event()

    # threading.Event's part the loop uses
    def wait(self, timeout: float) -> bool:
        if self.arrivals and self.arrivals[0] <= self.clock + timeout:
            self.clock = max(self.clock, self.arrivals.pop(0))
            self.queued += 1
            return True
        self.clock += timeout
        if self.clock >= self.until:
            self.stop.set()
        return False

    def set(self) -> None:
        pass

    def clear(self) -> None:
        pass

    # RelayStore's part the loop uses
    def experts_with_work(self) -> list[str]:
        return ["e"] if self.queued or self.always_work else []


def cycles(interval: float, cycle: float, arrivals: list[float] = (), always_work: bool = False,
           until: float = 60.0) -> list[tuple[float, bool]]:
    """(start time, had work) of each cycle the loop runs until the fake clock passes ``until``."""
    fake = FakeRelay(list(arrivals), always_work, until)
    forwarder = Forwarder.__new__(Forwarder)  # the loop alone: no blobs or upstream
    forwarder.policy, forwarder.store = ForwardPolicy(interval=interval), fake
    forwarder._stop, forwarder._wake, forwarder._clock = fake.stop, fake, lambda: fake.clock
    started: list[tuple[float, bool]] = []

    def forward_once() -> int:
        started.append((fake.clock, bool(fake.experts_with_work())))
        sent, fake.queued = fake.queued, 0
        fake.clock += cycle
        if fake.clock >= until:
            fake.stop.set()
        return sent

    forwarder.forward_once = forward_once  # type: ignore[method-assign]
    forwarder._loop()
    return started


@pytest.mark.parametrize("cycle, starts", [
    (3.0, [10.0, 20.0, 30.0, 40.0]),  # a short cycle: one every 10 s from the start of the one before
    (25.0, [10.0, 35.0]),  # longer than the interval: back to back, not 10 s after each ended (45 s)
    (0.0, [10.0, 20.0, 30.0, 40.0]),
])
def test_with_work_queued_cycles_start_an_interval_apart_not_an_interval_after_the_last_ended(cycle, starts):
    # (the start counts as a forward: after a restart, updates gather for one interval)
    assert [t for t, _ in cycles(10.0, cycle, always_work=True, until=41.0)] == pytest.approx(starts)


def test_an_update_reaching_an_idle_relay_goes_at_once_not_at_the_next_tick():
    # reports at 10, 20, 30 (no work); the update recorded at 37 is forwarded at 37, not at 40
    assert cycles(10.0, 0.5, arrivals=[37.0], until=38.0) == [(10.0, False), (20.0, False), (30.0, False),
                                                              (37.0, True)]


def test_updates_arriving_soon_after_a_forward_wait_for_the_interval_and_go_together():
    # the update at 15 goes at once; those at 16 and 19 wait for 25 (an interval after it), one batch
    run = cycles(10.0, 0.5, arrivals=[15.0, 16.0, 19.0], until=26.0)
    assert [(t, work) for t, work in run if work] == [(15.0, True), (25.0, True)]


def test_updates_right_after_a_start_gather_for_one_interval():
    run = cycles(10.0, 0.5, arrivals=[1.0, 4.0], until=11.0)
    assert run == [(10.0, True)]


def test_an_idle_relay_reports_every_interval_without_forwarding():
    assert cycles(10.0, 0.5, until=35.0) == [(10.0, False), (20.0, False), (30.0, False)]
