"""bench.gpu_check on a machine without CUDA: one line and exit 0; and every section it runs on a GPU, run here
on the CPU with tiny-qwen2, so the first GPU run meets no trivial error (device moves, autocast, codecs, merge)."""
import pytest
import torch

from bench import gpu_check
from tests.helpers import run_main
from worker.distributed import autocast, resolve_device


def test_without_cuda_it_says_so_in_one_line_and_exits_0():
    assert not torch.cuda.is_available()  # this machine; on a GPU machine the check itself runs
    code, out, err = run_main(gpu_check.main)
    assert code == 0 and out.count("\n") == 1 and out.startswith("gpu-check: no CUDA device is visible to torch")


def test_every_section_runs_on_the_cpu_without_an_error():
    # short sequences: bf16 autocast on a CPU without bf16 kernels took 5 minutes at the GPU run's 8 x 256 tokens
    args = gpu_check.Settings(model="tiny-qwen2", steps=2, batch_size=2, max_seq_len=32, codec_values=1 << 14)
    report = gpu_check.run_sections(args, "cpu")
    assert [name for name in gpu_check.SECTIONS if "error" in report[name]] == [], report
    assert set(report["worker"]) >= {"fp32", "bf16"}
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_mb"] is None for r in
               (report["worker"]["fp32"], report["worker"]["bf16"]))
    codecs = {k: v for k, v in report["codecs"].items() if k != "section_seconds"}
    assert len(codecs) == 13 and all(c["payload_equal"] and c["decoded_equal"] for c in codecs.values())
    assert report["merge"]["max_abs_difference_vs_cpu"] == 0.0
    assert report["comm_hooks"]["skipped"] == "needs 2 CUDA devices for NCCL, found 0"
    assert report["generation"]["new_tokens"] > 0


def test_a_device_move_pins_only_for_a_gpu():
    tensor = torch.arange(6.0)
    moved = gpu_check.to_device(tensor, "cpu")  # pin_memory() would raise here: no accelerator
    assert torch.equal(moved, tensor) and not moved.is_pinned()


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_autocast_computes_in_the_precision_asked_for(precision, dtype):
    layer = torch.nn.Linear(4, 4)
    with autocast("cpu", precision):
        assert layer(torch.randn(2, 4)).dtype == dtype
    assert layer.weight.dtype == torch.float32


def test_auto_device_is_the_cpu_here_and_cuda_is_refused_with_one_line():
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        resolve_device("cuda")
