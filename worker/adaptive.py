"""--compression auto: pick each sync's codec so its push (and pull) fits --sync-budget.

Pure policy, no I/O: a ``LinkEstimate`` per direction turns the timed transfers of earlier syncs
into bytes per second, and ``choose_push`` / ``choose_pull`` turn that, the budget and the size of
the update into a codec. ``probe_upload`` seeds the upload estimate at join from a timed 1 MiB
probe POST (``POST /api/v1/probe``) where the link is fast enough for one, so the first push is sized
from the link rather than from the conservative guess (which made a smollm2-135m worker's first 2-5
pushes random-k, docs/wan.md).

Throughput is the *effective* rate of whole requests (bytes / seconds, latency and server time
included), smoothed. That is pessimistic for small transfers, but self-correcting: a push sized
to ``budget * rate`` takes ``latency + bytes / bandwidth``; if that is under the budget the next
estimate rises, and the sizes settle where a push takes the budget (bytes = (budget - latency) *
bandwidth). Starting from a conservative guess, each sync grows the push by up to budget/latency,
and by at most ``GROWTH``.

The ladder, best quality first: fp32 safetensors (exact, 4 bytes a parameter), fp16 (2), int8
(~1.07), int4 (~0.57), then random-k + TernGrad with the ratio solved for the bytes allowed (0.25
bytes per kept entry: a 2-bit code, no indices, as the selection is regenerated from a seed in the
payload), from all entries down to ``LOSSY.min_ratio``. Neighbouring rungs are at most ~2.3x apart
in size, and the bytes allowed may grow by at most ``GROWTH`` (2.5x) over the largest push timed so
far, so one push can climb one rung but never jump from the random-k rung to fp16: a small push that
finished inside a token bucket's burst (tbf, or a NIC's) looks far faster than the link is, and
without the cap the next push was sized to that rate (an fp16 push of 8-9 s against a 1 s budget
in bench.adaptive, docs/wan.md). The dense rungs keep the worker's error feedback; the
random-k rung sends an unbiased estimate (kept values scaled by numel/k) and no residual, since on
the pretrained smollm2-135m random-k 10% + TernGrad without error feedback matched fp32 within
0.15% at 143x while top-k 1% + int8 with error feedback (the old last rung) kept ~10% of the
experts' gain (docs/history/benchmarks.md). The residual is in weight space, so switching codecs between
syncs loses nothing: a random-k update carries what an earlier int8 one left behind, then
leaves nothing (worker.encoding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from protocol.schemas import RAW_CODEC
from protocol.uploads import UploadPolicy
from worker.encoding import CodecChoice

CONSERVATIVE_BYTES_PER_SECOND = 125_000.0
"""Before any transfer was timed: 1 Mbit/s, a slow uplink."""
SMOOTHING = 0.5
"""Weight of the newest observation in the moving average."""

# Wire sizes, measured on LoRA adapters of tiny-qwen2 and smollm2-135m (docs/wan.md): bytes per
# parameter, and per tensor (headers and block scales).
# int4: 0.5625 (a 4-bit code and a 4-byte scale per 64 values) and ~5 bytes per tensor, measured on
# both presets' adapters; 24 per tensor kept as for int8 (over-estimating is the safe side).
RAW_BYTES, FP16_BYTES, INT8_BYTES, INT4_BYTES = 4.0, 2.0, 1.07, 0.57
TENSOR_OVERHEAD = {RAW_CODEC: 72, "fp16": 24, "int8": 24, "int4": 24}
DENSE = ((RAW_CODEC, RAW_BYTES), ("fp16", FP16_BYTES), ("int8", INT8_BYTES), ("int4", INT4_BYTES))
"""The dense rungs, with error feedback (int4 was +0.00% of fp32 on tiny-qwen2 in round 1 of docs/history/benchmarks.md)."""
PULL_DIFFS = (("fp16", FP16_BYTES), ("int8", INT8_BYTES), ("int4", INT4_BYTES))
GROWTH = 2.5
"""A push may be at most this many times the largest push timed so far: the largest step between
neighbouring rungs (int4 over random-k at every entry: 0.57 / 0.25 = 2.3), so the ladder is climbed
one rung per push, and the rate measured on a push that fit in a burst cannot size the next one."""


@dataclass(frozen=True)
class SparseRung:
    """A sparsifying codec whose ratio is solved for the bytes allowed, with its measured size model."""

    codec: str
    bytes_per_kept: float
    """Wire bytes per kept entry."""
    tensor_overhead: int
    """Wire bytes per tensor whatever the ratio (header, seed or index block, scale)."""
    min_ratio: float
    max_ratio: float
    options: tuple[tuple[str, Any], ...] = ()
    """Fixed codec options besides the ratio."""
    error_feedback: bool = True
    kept_table: tuple[tuple[float, float], ...] = ()
    """Measured (ratio, wire bytes per kept entry) points, ascending in ratio, for a codec whose cost per
    entry depends on the ratio (coded indices get cheaper as they get denser); interpolated linearly in
    log(ratio), held constant past either end. Empty: ``bytes_per_kept`` at every ratio."""

    def per_kept(self, ratio: float) -> float:
        table = self.kept_table
        if not table:
            return self.bytes_per_kept
        if ratio <= table[0][0]:
            return table[0][1]
        for (r0, b0), (r1, b1) in zip(table, table[1:]):
            if ratio <= r1:
                t = math.log(ratio / r0) / math.log(r1 / r0)
                return b0 + t * (b1 - b0)
        return table[-1][1]

    def size(self, ratio: float, numel: int, tensors: int) -> int:
        return int(self.per_kept(ratio) * ratio * numel + self.tensor_overhead * tensors)

    def ratio_for(self, allowed: float, numel: int, tensors: int) -> float:
        """The largest ratio whose update is at most about ``allowed`` bytes, within [min_ratio, max_ratio]."""
        if not self.kept_table:
            ratio = (allowed - self.tensor_overhead * tensors) / (self.bytes_per_kept * max(numel, 1))
            return min(self.max_ratio, max(self.min_ratio, ratio))
        low, high = self.min_ratio, self.max_ratio  # size() grows with the ratio: bisect
        if self.size(high, numel, tensors) <= allowed:
            return high
        if self.size(low, numel, tensors) >= allowed:
            return low
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (mid, high) if self.size(mid, numel, tensors) <= allowed else (low, mid)
        return low

    def choice(self, ratio: float, seed: int = 0) -> CodecChoice:
        """This codec at ``ratio``; a non-zero ``seed`` seeds every stage (one option mapping per stage)."""
        config: dict[str, Any] = {"ratio": ratio, **dict(self.options)}
        if seed:
            sparsifier, quantizer = self.codec.split("+")
            config = {sparsifier: {**config, "seed": seed}, quantizer: {"seed": seed}}
        return CodecChoice(self.codec, config, error_feedback=self.error_feedback)


def ratio_of(config: dict[str, Any]) -> float | None:
    """The sparsifier ratio of a codec config, flat ({"ratio": r}) or per stage ({"randomk": {"ratio": r}})."""
    if "ratio" in config:
        return float(config["ratio"])
    return next((float(v["ratio"]) for v in config.values() if isinstance(v, dict) and "ratio" in v), None)


LOSSY = SparseRung("randomk+terngrad", bytes_per_kept=0.25, tensor_overhead=17, min_ratio=0.01, max_ratio=1.0,
                   options=(("rescale", True),), error_feedback=False)
"""The last rung. 0.25 bytes per kept entry and 16-17 bytes per tensor (8-byte selection seed, 4-byte
scale, header) were measured with encode_update on rank-8 and rank-32 LoRA adapters of tiny-qwen2 and
rank-8 of smollm2-135m (ratios 0.01-1). The estimate is unbiased but its error grows as sqrt(1/ratio):
relative error ~4 at ratio 0.1, so below 0.01 (~14) an update's norm would be over 10x the delta's
and a coordinator's norm check at its default factor would refuse it. At ratio 1 it is TernGrad on
every entry, which is still 4x smaller than int8."""
TOPK_INT8 = SparseRung("topk+int8", bytes_per_kept=1.95, tensor_overhead=21, min_ratio=0.001, max_ratio=0.8,
                       kept_table=((0.003, 1.96), (0.01, 1.93), (0.05, 1.76), (0.1, 1.65), (0.2, 1.52), (0.3, 1.43),
                                   (0.4, 1.37), (0.5, 1.31), (0.6, 1.27), (0.7, 1.24), (0.8, 1.22)))
"""Top-k + int8 with error feedback (the quantizer has no seed). Per kept entry an int8 value, its share
of the block scales and its Golomb-Rice coded index gap: 1.96 bytes at ratio 0.003 down to 1.22 at 0.8,
measured with encode_update on the rank-8 LoRA shapes of smollm2-135m (420 tensors, 2.44 M entries;
tiny-qwen2's rank-8 shapes within 7% from ratio 0.1 up) plus 21 bytes a tensor. At ratio 0.8 it is
about int8's size (0.98 vs 1.06 bytes a parameter), so 0.8 is its largest ratio. Until 2026-11-25 the
model was a flat 1.95 bytes, right only near ratio 0.01: bench.adaptive's "same bytes" top-k at ratio
0.29 sent 1.01 MB where auto sent 1.37 MB.

Not on the ladder: bench.adaptive sizes its same-bytes comparison with it. Over 3 seeds on smollm2-135m
(docs/wan.md) it was the most erratic codec there: at ratio 0.285 (0.41 bytes a parameter) -0.010,
+0.063 and +0.011 of int4's held-out loss, at 0.16 -0.032, +0.045, +0.002, where int4, int8 and
random-k + TernGrad stayed within 0.003 of fp32 on every seed. One seed's win put it forward as a
rung; three do not."""


@dataclass
class LinkEstimate:
    """Smoothed effective throughput of one direction, in bytes per second."""

    bytes_per_second: float = CONSERVATIVE_BYTES_PER_SECOND
    observed: int = 0
    """Transfers timed so far (0: the value is the starting guess)."""
    largest: int = 0
    """The largest transfer timed so far, in bytes (what ``GROWTH`` caps a push against)."""

    def observe(self, nbytes: int, seconds: float) -> None:
        """Fold in one timed request of ``nbytes`` (ignored if it has no bytes or no duration)."""
        if nbytes <= 0 or not seconds > 0:
            return
        self.largest = max(self.largest, nbytes)
        rate = nbytes / seconds
        if self.observed == 0:
            self.bytes_per_second = rate
        else:  # averaged in log space: one stalled request must not swing the rate by its whole factor
            self.bytes_per_second = math.exp(SMOOTHING * math.log(rate)
                                             + (1 - SMOOTHING) * math.log(self.bytes_per_second))
        self.observed += 1

    def bytes_within(self, seconds: float) -> float:
        return self.bytes_per_second * seconds

    def push_allowance(self, seconds: float) -> float:
        """Bytes a push may have to take ``seconds``: the rate's worth, at most ``GROWTH`` x the largest
        transfer timed so far (no cap before the first: the starting guess is already conservative)."""
        allowed = self.bytes_within(seconds)
        return min(allowed, GROWTH * self.largest) if self.largest else allowed


ONE_SHOT_SECONDS = 2.0
"""A push the measured upload rate carries within this long goes in one request, however large (``upload_policy``)."""


def upload_policy(base: UploadPolicy, link: LinkEstimate) -> UploadPolicy:
    """``base`` with its resumable threshold raised to what the link carries in ``ONE_SHOT_SECONDS`` (never lowered).

    A resumable upload saves re-sending the body after a broken connection; on a link where the whole body takes
    under ~2 s that saves at most ~2 s, once per break, while its chunks cost every push: a 9.8 MB smollm2 update to a
    relay on the site's LAN took 0.72 s as an upload of 8 chunks and 0.08 s in one request (median of 5, the pushing
    process at a quarter core, docs/wan.md). On the 20 Mbit/s WAN the same body takes ~4 s: still resumable."""
    if not link.observed:
        return base
    threshold = max(base.threshold, int(link.bytes_within(ONE_SHOT_SECONDS)))
    return base if threshold == base.threshold else replace(base, threshold=threshold)


UPLOAD_PROBES = (64 << 10, 1 << 20)
"""Bytes of the join's upload probes. The small one only says whether the large one is affordable (at most
half the budget); its own rate is not kept: 64 KiB fits a token bucket's burst, so it can read 20x the link."""


def probe_upload(send: Callable[[int], float], budget_s: float, update_bytes: int) -> LinkEstimate:
    """The upload estimate from timed probes: ``send(nbytes)`` posts that many bytes and returns the seconds.

    Measured with the large probe (no larger than ``update_bytes``, the update in fp32: nothing is learned
    from sending more than a push ever will) when the small one says it takes at most half the budget;
    else the starting guess, unobserved (a slow link: pushes climb from there, as without a probe). A burst
    can fool the small probe into a large one that takes longer: once, at join, and at most one fp32
    push's worth, less than the full weights the join pulls. ``largest`` is the probe's size, so ``GROWTH``
    still caps the first push."""
    small, large = UPLOAD_PROBES[0], min(UPLOAD_PROBES[1], update_bytes)
    seconds = send(small)
    if large <= small or not seconds > 0 or large / (small / seconds) > budget_s / 2:
        return LinkEstimate()
    link = LinkEstimate()
    link.observe(large, send(large))
    return link


@dataclass(frozen=True)
class Decision:
    """A codec picked for one transfer, and why (for the log and the --results line)."""

    choice: CodecChoice | None
    """None for a pull: fetch the full weights."""
    allowed_bytes: int
    expected_bytes: int
    bytes_per_second: float
    fits: bool
    """False when even the smallest option is expected to overrun the budget."""
    details: dict = field(default_factory=dict)

    def record(self) -> dict:
        codec = self.choice.meta if self.choice is not None else {"codec": "full", "codec_config": {}}
        return {**codec, "allowed_bytes": self.allowed_bytes, "expected_bytes": self.expected_bytes,
                "bytes_per_second": round(self.bytes_per_second, 1), "fits": self.fits}


def dense_bytes(codec: str, bytes_per_param: float, numel: int, tensors: int) -> int:
    return int(bytes_per_param * numel + TENSOR_OVERHEAD.get(codec, 24) * tensors)


def choose_push(numel: int, tensors: int, budget_s: float, link: LinkEstimate, seed: int = 0) -> Decision:
    """The best-quality codec whose update of ``numel`` parameters in ``tensors`` tensors fits the budget.

    ``seed``: the worker's own seed for the random-k rung's selection (options ``seed``), so workers
    syncing at the same sync number do not all keep the same entries. The bytes allowed are the
    budget's worth at the measured rate, capped at ``GROWTH`` x the largest push timed so far.
    """
    allowed = link.push_allowance(budget_s)
    for codec, per_param in DENSE:
        expected = dense_bytes(codec, per_param, numel, tensors)
        if expected <= allowed:
            return Decision(CodecChoice(codec), int(allowed), expected, link.bytes_per_second, True)
    ratio = round(LOSSY.ratio_for(allowed, numel, tensors), 6)
    expected = LOSSY.size(ratio, numel, tensors)
    return Decision(LOSSY.choice(ratio, seed), int(allowed), expected, link.bytes_per_second, expected <= allowed)


def choose_pull(full_bytes: int, numel: int, tensors: int, budget_s: float, link: LinkEstimate) -> Decision:
    """Full weights when they can be fetched within the budget; else the largest diff codec that fits
    (the smallest if none does). Diffs are lossy, so the caller still pulls in full every N-th time."""
    allowed = link.bytes_within(budget_s)
    if full_bytes <= allowed:
        return Decision(None, int(allowed), full_bytes, link.bytes_per_second, True)
    for codec, per_param in PULL_DIFFS:
        expected = dense_bytes(codec, per_param, numel, tensors)
        if expected <= allowed:
            return Decision(CodecChoice(codec), int(allowed), expected, link.bytes_per_second, True)
    return Decision(CodecChoice(codec), int(allowed), expected, link.bytes_per_second, False)


@dataclass
class SyncPacing:
    """--comm-share: the sync interval stretched so that communication stays under a share of the worker's time.

    A sync's communication is its push and pull (link time, what a slow link or a busy coordinator costs); with
    overlap it runs beside training, and the next sync starts ``interval`` after this one did, so the share of the
    worker's time that the link is busy is ``comm / max(interval, comm)``. Keeping it at most ``share`` needs
    ``interval >= comm / share``. ``comm`` is smoothed in log space like the link rates (one stalled request must not
    stretch the interval by its whole factor), and the interval never goes below the user's ``--sync-interval`` (a
    fast link syncs as often as asked, no more) nor above ``MAX_STRETCH`` times it (a link that stalls for minutes
    must not stop a worker from syncing for hours). Each worker paces itself from its own measurements: on a mixed
    fleet a worker on a 5 Mbit/s link syncs less often than one on a LAN, and none waits for another.
    """

    floor: float
    """--sync-interval: the interval on a link that keeps within the share."""
    share: float
    """Largest fraction of the worker's time spent pushing and pulling, in (0, 1)."""
    comm_seconds: float = 0.0
    """Smoothed push + pull seconds of the syncs so far (0: none timed yet)."""

    MAX_STRETCH = 20.0

    def __post_init__(self) -> None:
        if not 0 < self.share < 1:
            raise ValueError(f"--comm-share must be in (0, 1), got {self.share}")

    def observe(self, comm_seconds: float) -> None:
        """Fold in one sync's push + pull seconds (a sync that moved nothing is ignored)."""
        if not comm_seconds > 0:
            return
        if not self.comm_seconds:
            self.comm_seconds = comm_seconds
        else:
            self.comm_seconds = math.exp(SMOOTHING * math.log(comm_seconds)
                                         + (1 - SMOOTHING) * math.log(self.comm_seconds))

    @property
    def interval(self) -> float:
        """Seconds from one sync's start to the next's."""
        return min(self.floor * self.MAX_STRETCH, max(self.floor, self.comm_seconds / self.share))
