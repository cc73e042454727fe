#!/usr/bin/env python3
"""A first run on a GPU, in at most ~5 minutes on one CUDA device: what works there and how fast.

    make gpu-check                      # python -m bench.gpu_check
    python -m bench.gpu_check --steps 4 --model tiny-qwen2

Sections (each records its numbers, or its error, and the check goes on to the next):

- worker:      LoRA training of --model (smollm2-135m by default) on DS-1000 pandas, fp32 then
               bf16 autocast: steps/s, tokens/s, peak GPU memory, held-out loss after the steps;
- codecs:      every update codec on a 4M-value tensor on the device against the same tensor on
               the CPU: encode MB/s, and whether the payloads and decoded values are equal;
- comm_hooks:  DDP's gradient all-reduce over NCCL with each comm codec (2+ devices only);
- merge:       the gateway's weighted-average merge of three experts on the device vs the CPU;
- generation:  batched greedy generation on the device (what serving would get): tokens/s.
               serve.py itself has no --device and runs on the CPU; this says what a GPU adds.

Writes bench/results/gpu_check.json (stamped with commit and load). Without CUDA it says so in one
line and exits 0. The same sections run on the CPU in tests/bench/test_gpu_check.py, so a first
GPU run meets no trivial error.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from bench.harness import Bench, Run
from protocol.cli import option

ROOT = Path(__file__).resolve().parents[1]
CODEC_VALUES = 1 << 22


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(torch.device(device))


def peak_mb(device: str) -> float | None:
    return torch.cuda.max_memory_allocated(torch.device(device)) / 2**20 if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(torch.device(device))


def to_device(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """A CPU tensor on device: through pinned memory, asynchronously, to a GPU; as is to the CPU."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def worker_section(device: str, model: str, steps: int, batch_size: int = 8, max_seq_len: int = 256) -> dict[str, Any]:
    from bench.common import DS1000_DIR
    from worker.data import load_examples
    from models.loading import load_base_model
    from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

    train = load_examples(DS1000_DIR / "train" / "pandas_expert.jsonl")[:batch_size * (steps + 1)]  # no repeats
    heldout = load_examples(DS1000_DIR / "heldout" / "pandas_expert.jsonl")[:batch_size]
    out = {}
    for precision in ("fp32", "bf16"):
        base = load_base_model(model, device=device)
        settings = TrainSettings(lr=1e-3, batch_size=batch_size, max_seq_len=max_seq_len, precision=precision)
        trainer = LoraTrainer(base, LoraSettings(rank=8), settings, train, device=device)
        trainer.train_steps(1)  # warm-up: kernels, allocator
        reset_peak(device)
        synchronize(device)
        started = time.perf_counter()
        stats = trainer.train_steps(steps)
        synchronize(device)
        seconds = time.perf_counter() - started
        out[precision] = {"steps_per_s": steps / seconds, "tokens_per_s": stats.tokens / seconds,
                          "peak_memory_mb": peak_mb(device), "train_loss": stats.loss,
                          "heldout_loss": trainer.eval_loss(heldout)}
    return out


def codec_section(device: str, numel: int) -> dict[str, Any]:
    from compression.registry import CODECS, make_codec

    values = torch.randn((numel // 1024, 1024), generator=torch.Generator().manual_seed(0))
    on_device = to_device(values, device)
    out = {}
    for name in CODECS:
        codec = make_codec(name)
        synchronize(device)
        started = time.perf_counter()
        payload = codec.encode(on_device, seed=7, shape=tuple(values.shape))
        seconds = time.perf_counter() - started
        reference = codec.encode(values, seed=7, shape=tuple(values.shape))
        decoded = codec.decode(payload, values.numel(), tuple(values.shape))
        out[name] = {"encode_mb_per_s": values.numel() * 4 / 2**20 / seconds, "payload_equal": payload == reference,
                     "decoded_equal": bool(torch.equal(decoded, codec.decode(reference, values.numel(),
                                                                             tuple(values.shape))))}
    return out


def merge_section(device: str) -> dict[str, Any]:
    from gateway.lora import LoraModule
    from gateway.merges import merge

    g = torch.Generator().manual_seed(0)
    experts = [{f"layers.{i}.q_proj": LoraModule(torch.randn(8, 896, generator=g), torch.randn(896, 8, generator=g), 2.0)
                for i in range(24)} for _ in range(3)]
    moved = [{k: LoraModule(to_device(m.A, device), to_device(m.B, device), m.scale) for k, m in e.items()}
             for e in experts]
    synchronize(device)
    started = time.perf_counter()
    on_device = merge("weighted_average", moved, [1.0, 1.0, 1.0])
    synchronize(device)
    seconds = time.perf_counter() - started
    on_cpu = merge("weighted_average", experts, [1.0, 1.0, 1.0])
    worst = max(float((on_device.modules[k].delta().cpu() - on_cpu.modules[k].delta()).abs().max())
                for k in on_cpu.modules)
    return {"seconds": seconds, "max_abs_difference_vs_cpu": worst}


def generation_section(device: str, model: str) -> dict[str, Any]:
    from models.loading import load_base_model

    base = load_base_model(model, device=device)
    prompts = [f"Write a Python function number {i} that adds two numbers." for i in range(8)]
    tokenizer = base.tokenizer
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    batch = {k: to_device(v, device) for k, v in batch.items()}
    synchronize(device)
    started = time.perf_counter()
    with torch.no_grad():
        output = base.model.generate(**batch, max_new_tokens=32, do_sample=False,  # type: ignore[operator]  # transformers' generate is a mixin mypy misses
                                     pad_token_id=tokenizer.pad_token_id)
    synchronize(device)
    seconds = time.perf_counter() - started
    new_tokens = (output.shape[1] - batch["input_ids"].shape[1]) * output.shape[0]
    return {"batch": len(prompts), "new_tokens": new_tokens, "tokens_per_s": new_tokens / seconds,
            "note": "serve.py has no --device and runs on the CPU; this is the model's own generate on the device"}


def comm_hook_section(device: str) -> dict[str, Any]:
    count = torch.cuda.device_count() if device.startswith("cuda") else 0
    if count < 2:
        return {"skipped": f"needs 2 CUDA devices for NCCL, found {count}"}
    import json
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_comm_rank, args=(out,), nprocs=2)
        return json.loads(Path(out, "rank0.json").read_text())


def _comm_rank(rank: int, out: str) -> None:
    import json

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from worker.comm_hooks import CommMeter, register_comm_hook

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=rank, world_size=2)
    torch.cuda.set_device(rank)
    results = {}
    for name, config in (("fp16", {}), ("bf16", {}), ("powersgd", {"matrix_approximation_rank": 4}), ("int8", {})):
        torch.manual_seed(0)
        model = torch.nn.Linear(1024, 1024).cuda(rank)
        ddp = DistributedDataParallel(model, device_ids=[rank])
        meter = CommMeter()
        register_comm_hook(ddp, name, config, meter)
        x = torch.randn(64, 1024, device=f"cuda:{rank}")
        ddp(x).pow(2).mean().backward()
        grad = model.weight.grad
        results[name] = {"grad_norm": float(grad.norm()) if grad is not None else None, **meter.take()}
    if rank == 0:
        Path(out, "rank0.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@dataclass(frozen=True)
class Settings:
    model: str = option("smollm2-135m", "base model of the worker and generation sections")
    steps: int = option(20, "measured training steps per precision")
    batch_size: int = option(8, "examples per training step")
    max_seq_len: int = option(256, "tokens per training example")
    codec_values: int = option(CODEC_VALUES, "values of the codec test tensor")
    device: str = option("cuda", "cuda, cuda:N (cpu only for the tests)")

    def __post_init__(self) -> None:
        if min(self.steps, self.batch_size, self.max_seq_len, self.codec_values) < 1:
            raise ValueError("--steps, --batch-size, --max-seq-len and --codec-values must be at least 1")


SECTIONS: dict[str, Callable[[Settings, str], dict[str, Any]]] = {
    "worker": lambda args, device: worker_section(device, args.model, args.steps, args.batch_size, args.max_seq_len),
    "codecs": lambda args, device: codec_section(device, args.codec_values),
    "comm_hooks": lambda args, device: comm_hook_section(device),
    "merge": lambda args, device: merge_section(device),
    "generation": lambda args, device: generation_section(device, args.model),
}


def run_sections(args: Settings, device: str) -> dict[str, Any]:
    """Every section's numbers, or {"error": ...}: one failure must not hide the others on a first GPU run."""
    report: dict[str, Any] = {}
    for name, section in SECTIONS.items():
        started = time.perf_counter()
        try:
            report[name] = section(args, device)
        except Exception as exc:  # noqa: BLE001 - recorded and reported: the point of a first run
            report[name] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
        report[name]["section_seconds"] = round(time.perf_counter() - started, 2)
    return report


def run(s: Settings, ctx: Run) -> int:
    if s.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device is visible to torch {torch.__version__}; nothing to check")
        return 0
    report = {"device": torch.cuda.get_device_name(torch.device(s.device)) if s.device.startswith("cuda")
              else "cpu", "devices": torch.cuda.device_count(), "torch": torch.__version__,
              "model": s.model, "steps": s.steps, **run_sections(s, s.device)}
    ctx.write(report)
    failed = [name for name in SECTIONS if "error" in report[name]]
    for name in SECTIONS:
        print(f"{name:11s} {report[name]}")
    print(f"results in {ctx.out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


BENCH = Bench("gpu_check", tags=("gpu",), settings=Settings, run=run,
              quick={"model": "tiny-qwen2", "steps": 4, "batch_size": 2, "max_seq_len": 64}, torch_threads=None)
main = BENCH.main

if __name__ == "__main__":
    sys.exit(main())
