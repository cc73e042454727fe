"""What a person watching a worker sees: a progress bar per sync interval and one line per sync.

``worker.federation.FederatedWorker`` calls two hooks: ``on_train_chunk`` after each chunk of
training steps (it moves the bar: seconds of the interval done, steps, loss, tokens/s) and
``on_sync`` with the sync's metrics record (the same dict that goes to ``--results``), which
closes the bar and logs one line. The bar is drawn only on a terminal (tqdm's ``disable=None``
turns it off when stderr is a file or a pipe), so logs written by a service manager get the one
line per sync and nothing else; with ``--log-format json`` that line is a JSON object carrying
the whole record.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any, Protocol, TextIO

from tqdm import tqdm

log = logging.getLogger("worker.sync")


class IntervalProgress(Protocol):
    """Running totals of the current interval (``worker.federation.IntervalStats``)."""

    steps: int
    tokens: int
    seconds: float

    @property
    def loss(self) -> float | None: ...

    @property
    def tokens_per_second(self) -> float:
        """Tokens over wall time, --speed-factor sleeps included."""


class SyncConsole:
    def __init__(self, sync_interval: float, progress: bool | None = None, stream: TextIO | None = None,
                 redraw_seconds: float = 0.5) -> None:
        """``progress``: True always draws the bar, False never, None only when ``stream`` is a terminal."""
        self.sync_interval = sync_interval
        self.redraw_seconds = redraw_seconds
        self.progress = progress
        self.stream = stream or sys.stderr
        self._bar: tqdm | None = None
        self._started = 0.0
        self._syncs = 0

    def on_train_chunk(self, interval: IntervalProgress) -> None:
        """Move the bar to the time spent in this interval; show steps, loss and tokens/s."""
        if self.progress is False:
            return
        if self._bar is None:
            self._started = time.monotonic()
            self._bar = tqdm(total=round(self.sync_interval, 1), desc=f"sync {self._syncs}", unit="s",
                             file=self.stream, disable=None if self.progress is None else False, leave=False,
                             dynamic_ncols=True, mininterval=self.redraw_seconds,
                             bar_format="{desc} {bar} {n:.0f}/{total:.0f} s{postfix}")
        if self._bar.disable:
            return
        loss = interval.loss
        self._bar.set_postfix_str(f"{interval.steps} steps, loss {_fmt(loss, 4)}, "
                                  f"{interval.tokens_per_second:.0f} tokens/s", refresh=False)
        done = min(time.monotonic() - self._started, self._bar.total)
        self._bar.update(done - self._bar.n)

    def on_sync(self, record: dict[str, Any]) -> None:
        """Close the interval's bar and log the sync's one line (the record rides along as fields)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._syncs = record.get("sync", self._syncs) + 1
        log.info("%s", sync_line(record), extra={"sync_record": record})


def sync_line(r: dict[str, Any]) -> str:
    """One readable line: training done, what was pushed, what was pulled, time spent syncing."""
    parts = [f"sync {r.get('sync', '?')}{' (final)' if r.get('final') else ''}:"]
    if "steps" in r:
        parts.append(f"{r['steps']} steps, loss {_fmt(r.get('train_loss'), 4)}, {_tokens_per_second(r)};")
        ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.3g}"
        flush = ", the final flush with the residual" if r.get("flushed_residual_norm") else ""
        parts.append(f"sent {_size(r.get('bytes_sent'))} (compression {ratio}x{flush});")
    elif r.get("dropped"):
        parts.append("update dropped (could not be encoded);")
    else:
        parts.append("nothing trained;")
    if not r.get("delivered", True):
        parts.append(f"coordinator unreachable, {r.get('outbox', 0)} update(s) queued;")
    elif r.get("pulled"):
        parts.append(f"pulled v{r.get('version')} ({_size(r.get('bytes_down'))});")
    parts.append(f"sync took {_fmt(r.get('sync_seconds'), 2)} s")
    return " ".join(parts)


def _tokens_per_second(r: dict[str, Any]) -> str:
    """Effective tokens/s (--speed-factor sleeps included), and the compute-only rate when they differ."""
    tokens, compute = r.get("tokens", 0), r.get("train_seconds") or 0.0
    effective = tokens / max(compute + (r.get("throttle_seconds") or 0.0), 1e-9)
    if not r.get("throttle_seconds"):
        return f"{effective:.0f} tokens/s"
    return f"{effective:.0f} tokens/s ({tokens / max(compute, 1e-9):.0f} computing, --speed-factor sleeps excluded)"


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"
