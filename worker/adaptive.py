"""--compression auto: pick each sync's codec so its push (and pull) fits --sync-budget.

Pure policy, no I/O: a ``LinkEstimate`` per direction turns the timed transfers of earlier syncs
into bytes per second, and ``choose_push`` / ``choose_pull`` turn that, the budget and the size of
the update into a codec.

Throughput is the *effective* rate of whole requests (bytes / seconds, latency and server time
included), smoothed. That is pessimistic for small transfers, but self-correcting: a push sized
to ``budget * rate`` takes ``latency + bytes / bandwidth``; if that is under the budget the next
estimate rises, and the sizes settle where a push takes the budget (bytes = (budget - latency) *
bandwidth). Starting from a conservative guess, each sync grows the push by up to budget/latency.

The ladder, best quality first: fp32 safetensors (exact, 4 bytes a parameter), fp16 (2), int8
(~1.07), then top-k + int8 with the ratio solved for the bytes allowed (~1.9 bytes per kept
entry: int8 value plus its coded index), down to ``MIN_RATIO``. Lossy choices rely on the
worker's error feedback, whose residual is in weight space, so switching codecs between syncs
loses nothing (worker.encoding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from protocol.schemas import RAW_CODEC
from worker.encoding import CodecChoice

CONSERVATIVE_BYTES_PER_SECOND = 125_000.0
"""Before any transfer was timed: 1 Mbit/s, a slow uplink."""
SMOOTHING = 0.5
"""Weight of the newest observation in the moving average."""
MIN_RATIO = 0.001
MAX_RATIO = 0.5
"""Top-k above half the entries is larger than int8 of them all."""

# Wire sizes, measured on LoRA adapters of tiny-qwen2 and smollm2-135m (docs/wan.md): bytes per
# parameter, per tensor (headers and block scales), and for top-k+int8 per kept entry.
RAW_BYTES, FP16_BYTES, INT8_BYTES = 4.0, 2.0, 1.07
TENSOR_OVERHEAD = {RAW_CODEC: 72, "fp16": 24, "int8": 24, "topk+int8": 21}
TOPK_INT8_BYTES_PER_KEPT = 1.95
DENSE = ((RAW_CODEC, RAW_BYTES), ("fp16", FP16_BYTES), ("int8", INT8_BYTES))
PULL_DIFFS = (("fp16", FP16_BYTES), ("int8", INT8_BYTES), ("int4", 0.57))


@dataclass
class LinkEstimate:
    """Smoothed effective throughput of one direction, in bytes per second."""

    bytes_per_second: float = CONSERVATIVE_BYTES_PER_SECOND
    observed: int = 0
    """Transfers timed so far (0: the value is the starting guess)."""

    def observe(self, nbytes: int, seconds: float) -> None:
        """Fold in one timed request of ``nbytes`` (ignored if it has no bytes or no duration)."""
        if nbytes <= 0 or not seconds > 0:
            return
        rate = nbytes / seconds
        if self.observed == 0:
            self.bytes_per_second = rate
        else:  # averaged in log space: one stalled request must not swing the rate by its whole factor
            self.bytes_per_second = math.exp(SMOOTHING * math.log(rate)
                                             + (1 - SMOOTHING) * math.log(self.bytes_per_second))
        self.observed += 1

    def bytes_within(self, seconds: float) -> float:
        return self.bytes_per_second * seconds


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


def topk_bytes(ratio: float, numel: int, tensors: int) -> int:
    return int(TOPK_INT8_BYTES_PER_KEPT * ratio * numel + TENSOR_OVERHEAD["topk+int8"] * tensors)


def topk_ratio_for(allowed: float, numel: int, tensors: int) -> float:
    """The top-k ratio whose top-k+int8 update is about ``allowed`` bytes, within [MIN_RATIO, MAX_RATIO]."""
    ratio = (allowed - TENSOR_OVERHEAD["topk+int8"] * tensors) / (TOPK_INT8_BYTES_PER_KEPT * max(numel, 1))
    return min(MAX_RATIO, max(MIN_RATIO, ratio))


def choose_push(numel: int, tensors: int, budget_s: float, link: LinkEstimate) -> Decision:
    """The best-quality codec whose update of ``numel`` parameters in ``tensors`` tensors fits the budget."""
    allowed = link.bytes_within(budget_s)
    for codec, per_param in DENSE:
        expected = dense_bytes(codec, per_param, numel, tensors)
        if expected <= allowed:
            return Decision(CodecChoice(codec), int(allowed), expected, link.bytes_per_second, True)
    ratio = round(topk_ratio_for(allowed, numel, tensors), 6)
    expected = topk_bytes(ratio, numel, tensors)
    return Decision(CodecChoice("topk+int8", {"ratio": ratio}), int(allowed), expected, link.bytes_per_second,
                    expected <= allowed)


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
