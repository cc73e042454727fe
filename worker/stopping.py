"""Stopping on a signal at a step boundary, so a step's weights and its accounting never part.

SIGTERM (systemd, ``docker stop``, ``kill``) and Ctrl-C end a worker's run with the final push
that flushes what it trained. Raising ``KeyboardInterrupt`` straight from the signal handler did
that, but wherever Python happened to be: after an optimiser step had moved the weights and before
the trainer returned its statistics, the step was pushed yet never counted (the coordinator got
317 steps of training described as 316), and inside the optimiser it could stop half way.

``STOP`` is the process's one stop request. While ``FederatedWorker.run`` trains, it is *armed*: a
first signal only sets ``requested``, and the loop checks it between steps, then ends the usual
way (wait for the sync in flight, final push). When nothing is armed (loading the model, joining)
or at a second signal, the handler raises ``KeyboardInterrupt`` at once, as Python's own would.
"""
from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any, Callable

log = logging.getLogger(__name__)

Handler = Callable[[int, FrameType | None], Any] | int | None


class StopRequest:
    """A stop asked for by a signal, honoured at the training loop's next step boundary."""

    def __init__(self) -> None:
        self.armed = False
        self.requested = False

    def arm(self) -> None:
        """The training loop is on: from now the first signal waits for the step to end."""
        self.armed, self.requested = True, False

    def disarm(self) -> None:
        self.armed = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.armed and not self.requested:
            self.requested = True  # a plain attribute: the handler runs on the main thread between bytecodes
            log.info("%s: stopping after this training step, then pushing what was trained "
                     "(send it again to stop at once)", signal.Signals(signum).name)
            return
        raise KeyboardInterrupt


STOP = StopRequest()


def stop_on_signals() -> dict[int, Handler]:
    """Route SIGTERM, and Ctrl-C where Python would turn it into KeyboardInterrupt, to ``STOP``; returns
    the handlers replaced (for ``restore``). Only the main thread may set handlers; elsewhere, nothing."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    replaced: dict[int, Handler] = {signal.SIGTERM: signal.signal(signal.SIGTERM, STOP.handle)}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored (nohup, &)
        replaced[signal.SIGINT] = signal.signal(signal.SIGINT, STOP.handle)
    return replaced


def restore(replaced: dict[int, Handler]) -> None:
    for signum, handler in replaced.items():
        signal.signal(signum, handler)
