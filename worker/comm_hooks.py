"""Compressed gradient all-reduce inside a data-parallel worker: DDP comm hooks and their meter.

`--comm-compress NAME` picks one of:
- `fp16`, `bf16`, `powersgd`: torch's own hooks (default_hooks.fp16/bf16_compress_hook and
  powerSGD_hook, Vogels et al. 2019, with its error feedback and warm start);
- any codec of this project's compression/ registry (`int8`, `topk`, `topk+int8`, ...): each rank
  encodes its bucket, the payloads are all-gathered and every rank decodes and averages them.
  Sparsifiers and low-rank codecs keep an error-feedback residual per bucket (Stich et al. 2018),
  off with {"error_feedback": false}.

Every hook reports to a CommMeter: bytes this rank would send uncompressed and compressed,
compression and communication time, and (unless {"measure_error": false}) the relative error and
cosine of the averaged gradient it delivered against the exact average, which costs one extra
uncompressed all-reduce per bucket, excluded from the times and bytes.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from compression import CompressionError, make_codec

log = logging.getLogger(__name__)

TORCH_HOOKS = ("fp16", "bf16", "powersgd")
POWERSGD_DEFAULTS = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
OWN_KEYS = ("measure_error", "error_feedback")


@dataclass
class CommMeter:
    """What the comm hook did since the last `take()` (one optimiser step)."""

    bytes_raw: int = 0
    bytes_sent: int = 0
    entries_raw: int = 0
    entries_sent: int = 0
    compress_s: float = 0.0
    comm_s: float = 0.0
    error_sq: float = 0.0
    exact_sq: float = 0.0
    delivered_sq: float = 0.0
    dot: float = 0.0
    measured: bool = False

    def compare(self, delivered: torch.Tensor, exact: torch.Tensor) -> None:
        """Accumulate the distortion of one bucket's delivered average against the exact one."""
        d, e = delivered.double(), exact.double()
        self.error_sq += float((d - e).square().sum())
        self.exact_sq += float(e.square().sum())
        self.delivered_sq += float(d.square().sum())
        self.dot += float((d * e).sum())
        self.measured = True

    def take(self) -> dict[str, Any]:
        """This step's metrics (the keys --results step lines carry), then start over."""
        record = {"bytes_raw": self.bytes_raw, "bytes_sent": self.bytes_sent,
                  "ratio": self.bytes_raw / self.bytes_sent if self.bytes_sent else None,
                  "density": self.entries_sent / self.entries_raw if self.entries_raw else None,
                  "compress_ms": round(1000 * self.compress_s, 3), "comm_ms": round(1000 * self.comm_s, 3),
                  "grad_rel_error": None, "grad_cosine": None}
        if self.measured:
            record["grad_rel_error"] = math.sqrt(self.error_sq / self.exact_sq) if self.exact_sq else 0.0
            norms = math.sqrt(self.exact_sq * self.delivered_sq)
            record["grad_cosine"] = self.dot / norms if norms else 1.0
        for f in fields(self):  # start over: every counter back to its default
            setattr(self, f.name, f.default)
        return record


def check_comm_codec(name: str, config: dict[str, Any]) -> None:
    """Refuse an unknown codec or bad options now, in one line naming the flag."""
    options = {k: v for k, v in config.items() if k not in OWN_KEYS}
    if name == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        unknown = sorted(set(options) - set(powerSGD_hook.PowerSGDState.__init__.__code__.co_varnames))
        if unknown or "process_group" in options:
            raise ValueError(f"--comm-config: unknown PowerSGD option(s) {unknown or ['process_group']}")
        return
    if name in TORCH_HOOKS:
        if options:
            raise ValueError(f"--comm-config: --comm-compress {name} takes no options, got {sorted(options)}")
        return
    try:
        make_codec(name, options)
    except CompressionError as exc:
        raise ValueError(f"--comm-compress {name}: {exc}") from None


def register_comm_hook(ddp: DistributedDataParallel, name: str, config: dict[str, Any], meter: CommMeter | None) -> None:
    """Register the hook called `name` on a DistributedDataParallel module."""
    meter = meter if meter is not None else CommMeter()
    measure = bool(config.get("measure_error", True))
    options = {k: v for k, v in config.items() if k not in OWN_KEYS}
    if name in TORCH_HOOKS:
        state, hook = _torch_hook(name, options)
        ddp.register_comm_hook(MeteredState(state, meter, measure, _torch_hook_bytes(name, state)), metered_hook(hook))
    else:
        error_feedback = bool(config.get("error_feedback", True))
        ddp.register_comm_hook(CodecState(make_codec(name, options), meter, measure, error_feedback), codec_hook)
    log.info("gradient all-reduce compressed with %s %s", name, options or "")


# torch's own hooks, metered ----------------------------------------------------------------------

@dataclass
class MeteredState:
    inner: Any
    meter: CommMeter
    measure: bool
    bytes_sent: Callable[[dist.GradBucket, Any], tuple[int, int]]
    """(bytes, entries) this rank sends for a bucket under the wrapped hook."""


def _torch_hook(name: str, options: dict[str, Any]) -> tuple[Any, Callable]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, **{**POWERSGD_DEFAULTS, **options})
        return state, powerSGD_hook.powerSGD_hook
    return None, {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[name]


def _torch_hook_bytes(name: str, state: Any) -> Callable[[dist.GradBucket, Any], tuple[int, int]]:
    if name in ("fp16", "bf16"):
        return lambda bucket, _: (2 * bucket.buffer().numel(), bucket.buffer().numel())
    return _powersgd_bytes


def _powersgd_bytes(bucket: dist.GradBucket, state: Any) -> tuple[int, int]:
    """What powerSGD_hook all-reduces for this bucket: P and Q of each compressible matrix, the rest as is."""
    numel = bucket.buffer().numel()
    if state.iter < state.start_powerSGD_iter:  # torch's hook runs a plain all-reduce for the first iterations
        return 4 * numel, numel
    sent = 0
    for grad in bucket.gradients():
        n, m = grad.shape[0], grad.numel() // max(grad.shape[0], 1)
        rank = min(n, m, state.matrix_approximation_rank)
        compressible = grad.ndim > 1 and n * m >= (n + m) * rank * state.min_compression_rate
        sent += (n + m) * rank if compressible else grad.numel()
    return 4 * sent, sent


def metered_hook(hook: Callable) -> Callable:
    def run(state, bucket):  # no annotations: DDP checks them, and this module's are strings
        exact = _exact_average(bucket.buffer()) if state.measure else None
        sent_bytes, sent_entries = state.bytes_sent(bucket, state.inner)
        started = time.perf_counter()
        delivered = hook(state.inner, bucket).wait()  # waiting here trades overlap for an honest time
        _account(state.meter, bucket.buffer().numel(), sent_bytes, sent_entries, 0.0,
                 time.perf_counter() - started)
        if exact is not None:
            state.meter.compare(delivered, exact)
        return _done(delivered)

    return run


# codecs of compression/ ---------------------------------------------------------------------------

@dataclass
class CodecState:
    codec: Any
    meter: CommMeter
    measure: bool
    error_feedback: bool
    step: int = 0
    residual: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per parameter (by id): DDP rebuilds its buckets after the first step, so buckets are no stable key."""


def codec_hook(state, bucket):  # (CodecState, dist.GradBucket) -> Future; DDP checks real annotations only
    """Encode this rank's bucket, all-gather the payloads, decode and average them on every rank."""
    grad = bucket.buffer()
    exact = _exact_average(grad) if state.measure else None
    started = time.perf_counter()
    target = grad.detach().to(torch.float32)
    params = bucket.parameters()
    if state.error_feedback and state.residual:
        target = target + torch.cat([state.residual.get(id(p), torch.zeros(p.numel(), device=grad.device))
                                     for p in params])
    payload = state.codec.encode(target.cpu(), seed=state.step)
    if state.error_feedback:
        left = target - state.codec.decode(payload, target.numel()).to(target.device)
        state.residual.update(zip(map(id, params), left.split([p.numel() for p in params])))
    compressed = time.perf_counter()
    payloads = _all_gather_bytes(payload, grad.device)
    communicated = time.perf_counter()
    total = sum(state.codec.decode(p, grad.numel()) for p in payloads)
    grad.copy_((total / len(payloads)).to(grad.device, grad.dtype))
    decoded = time.perf_counter()
    sent = state.codec.inspect(payload, grad.numel()).sent
    _account(state.meter, grad.numel(), len(payload), sent, (compressed - started) + (decoded - communicated),
             communicated - compressed)
    if exact is not None:
        state.meter.compare(grad, exact)
    if bucket.is_last():
        state.step += 1
    return _done(grad)


def _all_gather_bytes(payload: bytes, device: torch.device) -> list[bytes]:
    """Every rank's payload (of any length): lengths first, then the payloads padded to the longest."""
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if payload else \
        torch.zeros(0, dtype=torch.uint8, device=device)
    world = dist.get_world_size()
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(payload)], dtype=torch.int64, device=device))
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:len(payload)] = mine
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [g[:int(n)].cpu().numpy().tobytes() for g, n in zip(gathered, lengths)]


# shared ---------------------------------------------------------------------------------------

def _exact_average(grad: torch.Tensor) -> torch.Tensor:
    exact = grad.detach().clone()
    dist.all_reduce(exact)
    return exact / dist.get_world_size()


def _account(meter: CommMeter, numel: int, sent_bytes: int, sent_entries: int, compress_s: float,
             comm_s: float) -> None:
    meter.bytes_raw += 4 * numel
    meter.entries_raw += numel
    meter.bytes_sent += sent_bytes
    meter.entries_sent += sent_entries
    meter.compress_s += compress_s
    meter.comm_s += comm_s


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future
