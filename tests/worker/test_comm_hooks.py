"""worker.comm_hooks: DDP's gradient all-reduce compressed on two gloo CPU ranks, and the per-step
metrics it appends to --results checked against the gradient one process computes on the same batch."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.worker import comm_ranks
from tests.worker.conftest import spawn_ranks
from tests.worker.test_strategies import free_port, single_process
from worker.comm_hooks import CommMeter


@pytest.fixture(scope="module")
def codec_runs(tmp_path_factory):
    """{codec: its three --results step lines}, and rank 0's first-step gradients per codec."""
    out = tmp_path_factory.mktemp("comm")
    spawn_ranks(comm_ranks.main, free_port(), str(out), list(comm_ranks.CODECS))
    lines = {name: [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
             for name in comm_ranks.CODECS}
    grads = {name: load_file(out / f"{name}-grads.safetensors") for name in comm_ranks.CODECS}
    return lines, grads


@pytest.fixture(scope="module")
def exact():
    losses, grads, _ = single_process("ddp-lora")
    return losses, grads


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    x = torch.cat([a[k].reshape(-1).double() for k in sorted(a)])
    y = torch.cat([b[k].reshape(-1).double() for k in sorted(a)])
    return float(x @ y / (x.norm() * y.norm()))


@pytest.mark.slow  # two torch ranks spawned (mp.spawn)
@pytest.mark.parametrize("codec", list(comm_ranks.CODECS))
def test_step_lines_count_the_bytes_and_measure_the_delivered_gradient(codec_runs, exact, codec):
    lines, grads = codec_runs
    steps = lines[codec]
    assert [s["step"] for s in steps] == [1, 2, 3] and all(s["event"] == "step" for s in steps)
    assert all(s["comm_compress"] == codec and s["strategy"] == "ddp" and s["world_size"] == 2 for s in steps)
    assert steps[0]["loss"] == pytest.approx(exact[0][0], rel=1e-6)  # same global batch as one process
    lora_numel = sum(g.numel() for g in exact[1].values())
    assert all(s["bytes_raw"] == 4 * lora_numel for s in steps)  # every LoRA gradient, once per step
    assert all(s["tokens_per_s"] > 0 and s["peak_memory_mb"] > 100 and s["comm_ms"] >= 0 for s in steps)
    # What the hook says it delivered is what rank 0 really stepped with: its gradient's cosine to the
    # single-process gradient (clipping rescales both, cosine ignores that) is the meter's cosine.
    assert cosine(grads[codec], exact[1]) == pytest.approx(steps[0]["grad_cosine"], abs=2e-4)


@pytest.mark.slow  # two torch ranks spawned (mp.spawn)
def test_casts_halve_the_bytes_with_tiny_error(codec_runs):
    lines, _ = codec_runs
    for codec in ("fp16", "bf16"):
        for s in lines[codec]:
            assert (2 * s["bytes_sent"], s["ratio"], s["density"]) == (s["bytes_raw"], 2.0, 1.0)
            assert 0 < s["grad_rel_error"] < (1e-3 if codec == "fp16" else 1e-2)


@pytest.mark.slow  # two torch ranks spawned (mp.spawn)
def test_int8_and_topk_send_what_their_codec_encodes(codec_runs):
    lines, _ = codec_runs
    for s in lines["int8"]:
        assert 3.5 < s["ratio"] < 4.0 and s["density"] == 1.0 and 0 < s["grad_rel_error"] < 0.02
        assert s["compress_ms"] > 0
    for s in lines["topk"]:
        assert s["density"] == pytest.approx(0.1, abs=0.002) and s["ratio"] > 8
        assert 0.1 < s["grad_rel_error"] < 1 and 0.5 < s["grad_cosine"] < 0.99  # lossy, and measured so


@pytest.mark.slow  # two torch ranks spawned (mp.spawn)
def test_powersgd_starts_uncompressed_then_sends_low_rank_factors(codec_runs):
    lines, _ = codec_runs
    first, second, third = lines["powersgd"]
    assert first["ratio"] == second["ratio"] == 1.0 and first["grad_rel_error"] == 0.0
    # rank 2 over 128 x 128 and 128 x 8 matrices: P and Q are (n + m) * 2 entries where that is smaller
    assert 2 < third["ratio"] < 8 and third["density"] < 0.5 and third["grad_rel_error"] > 0


def test_meter_reports_a_step_and_starts_over():
    meter = CommMeter()
    meter.bytes_raw, meter.bytes_sent, meter.entries_raw, meter.entries_sent = 400, 100, 100, 10
    meter.compare(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]))
    record = meter.take()
    assert (record["ratio"], record["density"]) == (4.0, 0.1)
    assert record["grad_rel_error"] == pytest.approx(math.sqrt(1 / 2))
    assert record["grad_cosine"] == pytest.approx(1 / math.sqrt(2))
    assert meter.take()["bytes_raw"] == 0 and meter.take()["grad_cosine"] is None
