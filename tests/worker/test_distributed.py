"""worker.distributed and the trainer's precision, accumulation and checkpointing flags (one process)."""
import logging

import pytest
import torch

from worker.data import IGNORE_INDEX, collate, load_examples, sample_dataset_path, split_examples
from worker.distributed import (DistributedSetupError, SingleProcess, autocast, check_precision, grad_scaler,
                                resolve_device, start)
from models.loading import load_base_model
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings, labelled_positions, micro_batches

SETTINGS = TrainSettings(lr=1e-2, batch_size=8, max_seq_len=128, seed=0)


@pytest.fixture(scope="module")
def train_examples():
    return split_examples(load_examples(sample_dataset_path("python_expert")))[0]


def trained_state(examples, steps: int = 2, **settings) -> tuple[dict[str, torch.Tensor], list[float], LoraTrainer]:
    """(adapter after `steps` steps, their losses, the trainer); the last step's gradients stay in p.grad."""
    settings = {**SETTINGS.__dict__, **settings}
    trainer = LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(), TrainSettings(**settings), examples)
    losses = [trainer.train_steps(1).loss for _ in range(steps)]
    return trainer.adapter_state(), losses, trainer


def gradients(trainer: LoraTrainer) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in trainer.model.parameters() if p.requires_grad]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def relative_gradient_error(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Largest element error over the largest gradient element: Adam hides a wrong gradient scale, this does not."""
    scale = max(float(g.abs().max()) for g in reference)
    return max(float((g - r).abs().max()) for g, r in zip(grads, reference)) / scale


# Two AdamW steps at lr 1e-2: an element whose gradient is ~0 moves by up to ~lr on rounding noise alone,
# so weights are compared loosely (a tenth of a step) and gradients tightly.
WEIGHT_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def fp32_run(train_examples):
    state, losses, trainer = trained_state(train_examples)
    return state, losses, gradients(trainer)


# devices and flags --------------------------------------------------------------------------------

def test_auto_picks_cpu_on_a_machine_without_accelerators():
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("this machine has an accelerator")
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto", local_rank=1, local_world_size=2) == "cpu"  # CPU ranks share the CPU
    assert start("auto")[1] == "cpu" and isinstance(start("cpu")[0], SingleProcess)


@pytest.mark.parametrize("device, message", [
    ("cuda", "--device cuda: no CUDA device is visible"),
    ("cuda:1", "--device cuda: no CUDA device is visible"),
    ("mps", "--device mps: the MPS backend is not available"),
    ("tpu", "--device must be one of auto, cpu, cuda, mps (or cuda:N), got 'tpu'"),
    ("cpu:0", "--device must be one of"),
])
def test_a_device_that_cannot_work_is_one_clear_error(device, message):
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("this machine has an accelerator")
    with pytest.raises(DistributedSetupError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as err:
        resolve_device(device)
    assert "\n" not in str(err.value)


def test_precision_checks(caplog):
    with pytest.raises(DistributedSetupError, match="--precision must be one of fp32, bf16, fp16, got 'fp8'"):
        check_precision("fp8", "cpu")
    with caplog.at_level(logging.WARNING, logger="worker.distributed"):
        check_precision("bf16", "cpu")
        assert not caplog.records
        check_precision("fp16", "cpu")
    assert "fp16 on CPU works but is slow" in caplog.text
    with pytest.raises(ValueError, match="--grad-accum must be at least 1, got 0"):
        TrainSettings(grad_accum=0)
    with pytest.raises(ValueError, match="--precision must be one of"):
        TrainSettings(precision="half")


def test_autocast_and_scaler_follow_the_precision():
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with autocast("cpu", precision):
            assert layer(x).dtype == dtype
    assert grad_scaler("cpu", "fp16").is_enabled()
    assert not grad_scaler("cpu", "bf16").is_enabled() and not grad_scaler("cpu", "fp32").is_enabled()


def test_single_process_collective_is_a_no_op():
    one = SingleProcess()
    state = {"a": torch.ones(2)}
    model = torch.nn.Linear(2, 2)
    assert (one.rank, one.world_size, one.is_primary) == (0, 1, True)
    assert one.agree(True) is True and one.agree(False) is False and one.sum(2.5) == 2.5
    assert one.broadcast_state(state) is state and one.wrap(model, "cpu") is model
    one.check_same("anything", "x")


# the data-parallel sampler ----------------------------------------------------------------------

def test_ranks_and_micro_batches_cover_a_global_batch_exactly_once():
    encoded = [([i] * (i + 2), [IGNORE_INDEX] + [i] * (i + 1)) for i in range(7)]  # row i has i + 2 tokens
    batch = collate(encoded, pad_id=0)
    seen = []
    for rank in range(2):
        parts = micro_batches(batch, rank, 2, grad_accum=2)
        assert len(parts) == 2
        for part in parts:
            length = int(part.attention_mask.sum(dim=1).max())
            assert part.input_ids.shape[1] == length  # padding no kept row needs is trimmed away
            seen += [int(row[0]) for row in part.input_ids]
    assert [int(r[0]) for r in micro_batches(batch, 0, 2, 2)[0].input_ids] == [0, 2]  # DistributedSampler's rule
    assert sorted(seen) == list(range(7))
    assert sum(labelled_positions(p) for r in range(2) for p in micro_batches(batch, r, 2, 2)) == \
        labelled_positions(batch)
    assert micro_batches(batch, 0, 1, 1)[0] is batch
    assert micro_batches(collate(encoded[:1], 0), 1, 2, 1) == [None]  # a short final batch leaves a rank idle


def test_batch_smaller_than_ranks_times_accumulation_is_refused(train_examples):
    with pytest.raises(ValueError, match=r"--batch-size 2 is smaller than 1 process\(es\) x --grad-accum 4"):
        LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(), TrainSettings(batch_size=2, grad_accum=4),
                    train_examples)


# accumulation, precision, checkpointing ---------------------------------------------------------

@pytest.mark.slow
def test_accumulated_micro_batches_take_the_big_batch_step(train_examples, fp32_run):
    state, losses, grads = fp32_run
    accumulated, accumulated_losses, trainer = trained_state(train_examples, grad_accum=4)
    assert accumulated_losses == pytest.approx(losses, rel=1e-5)
    assert relative_gradient_error(gradients(trainer), grads) < 1e-4
    assert max_difference(accumulated, state) < WEIGHT_TOLERANCE
    assert max(float(v.abs().max()) for k, v in state.items() if "lora_B" in k) > 1e-3  # it did move


@pytest.mark.slow
def test_uneven_accumulation_weights_every_answer_token_once(train_examples, fp32_run):
    """3 micro-batches of 3, 3 and 2 examples with different answer lengths: still the batch's token mean."""
    state, losses, grads = fp32_run
    accumulated, accumulated_losses, trainer = trained_state(train_examples, grad_accum=3)
    assert accumulated_losses == pytest.approx(losses, rel=1e-5)
    assert relative_gradient_error(gradients(trainer), grads) < 1e-4
    assert max_difference(accumulated, state) < WEIGHT_TOLERANCE


@pytest.mark.slow
def test_gradient_checkpointing_gives_the_same_step(train_examples, fp32_run):
    state, losses, grads = fp32_run
    checkpointed, checkpointed_losses, trainer = trained_state(train_examples, gradient_checkpointing=True)
    assert all(layer.gradient_checkpointing for layer in trainer.model.base_model.model.model.layers)
    assert checkpointed_losses == pytest.approx(losses, rel=1e-5)
    assert relative_gradient_error(gradients(trainer), grads) < 1e-4
    assert max_difference(checkpointed, state) < WEIGHT_TOLERANCE


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.slow
def test_mixed_precision_trains_close_to_fp32_and_keeps_float32_weights(train_examples, fp32_run, precision):
    state, losses, grads = fp32_run
    mixed, mixed_losses, trainer = trained_state(train_examples, precision=precision)
    assert mixed_losses != losses  # autocast really changed the arithmetic
    assert mixed_losses == pytest.approx(losses, rel=0.02)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert relative_gradient_error(gradients(trainer), grads) < 0.05
    assert all(g.dtype == torch.float32 for g in gradients(trainer))  # unscaled float32 gradients
    assert trainer._scaler.is_enabled() == (precision == "fp16")
    if precision == "fp16":  # the scaled fp16 gradients were finite, so every step was taken
        assert trainer._scaler.get_scale() == 2.0 ** 16


# the command line ---------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--device", "cuda"], "error: --device cuda: no CUDA device is visible to torch"),
    (["--device", "tpu"], "error: --device must be one of auto, cpu, cuda, mps"),
    (["--grad-accum", "0"], "error: --grad-accum must be at least 1, got 0"),
    (["--batch-size", "2", "--grad-accum", "4", "--device", "cpu"],
     "error: --batch-size 2 is smaller than 1 process(es) x --grad-accum 4"),
])
def test_run_worker_refuses_a_combination_that_cannot_work_in_one_line(flags, message, capsys):
    import run_worker

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code = run_worker.main(["--specialty", "sql_expert", "--base-model", "tiny-qwen2",
                            "--coordinator-url", "http://127.0.0.1:9", *flags])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(message), err


def test_run_worker_passes_the_new_flags_to_the_trainer():
    import run_worker

    config = run_worker.build_config(run_worker.parse_args(
        ["--specialty", "sql_expert", "--precision", "bf16", "--grad-accum", "2", "--gradient-checkpointing"]))
    assert (config.train.precision, config.train.grad_accum, config.train.gradient_checkpointing) == ("bf16", 2, True)
    assert config.device == "auto"
    defaults = run_worker.build_config(run_worker.parse_args(["--specialty", "sql_expert"]))
    assert (defaults.train.precision, defaults.train.grad_accum, defaults.train.gradient_checkpointing) == \
        ("fp32", 1, None)  # None: the trainer decides from the model and batch (worker.memory.want_checkpointing)
    for value, expected in (("auto", None), ("on", True), ("off", False)):
        config = run_worker.build_config(run_worker.parse_args(
            ["--specialty", "sql_expert", "--gradient-checkpointing", value]))
        assert config.train.gradient_checkpointing is expected
