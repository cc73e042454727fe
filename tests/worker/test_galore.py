"""worker.galore: GaLore's update against a direct computation of the paper's Algorithm 1 on small matrices,
plain AdamW where nothing is projected, a checkpoint round trip without pickle, and a full-parameter trainer."""
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.checkpoint import flatten_optimizer, unflatten_optimizer
from worker.galore import GaLoreAdamW, GaLoreSettings, state_bytes
from models.loading import load_base_model
from worker.optimizers import OptimizerSettings
from worker.trainer import LoraSettings, LoraTrainer, TrainSettings

LR, RANK, INTERVAL, SCALE, EPS, BETAS = 0.01, 2, 2, 0.5, 1e-8, (0.9, 0.999)


def gradients(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(steps)]


def paper_update(weight, grads):
    """Algorithm 1 written out: P from the SVD of G every INTERVAL steps; R = G P^T (m >= n) or P^T G;
    Adam moments of R with bias correction; W -= lr * scale * (N P or P N)."""
    weight = weight.clone()
    m_rows, n_cols = weight.shape
    moment1 = moment2 = None
    for t, grad in enumerate(grads, start=1):
        if (t - 1) % INTERVAL == 0:
            u, _, vh = torch.linalg.svd(grad, full_matrices=False)
            basis = vh[:RANK] if m_rows >= n_cols else u[:, :RANK]
        low = grad @ basis.T if m_rows >= n_cols else basis.T @ grad
        moment1 = (1 - BETAS[0]) * low if moment1 is None else BETAS[0] * moment1 + (1 - BETAS[0]) * low
        moment2 = (1 - BETAS[1]) * low ** 2 if moment2 is None else BETAS[1] * moment2 + (1 - BETAS[1]) * low ** 2
        direction = (moment1 / (1 - BETAS[0] ** t)) / ((moment2 / (1 - BETAS[1] ** t)).sqrt() + EPS)
        full = direction @ basis if m_rows >= n_cols else basis @ direction
        weight -= LR * SCALE * full
    return weight


def run_galore(weight, grads, projected=True, state=None):
    param = torch.nn.Parameter(weight.clone())
    group = {"params": [param]} | ({"rank": RANK, "update_interval": INTERVAL, "scale": SCALE} if projected else {})
    optimizer = GaLoreAdamW([group], lr=LR, betas=BETAS, eps=EPS)
    if state is not None:
        optimizer.load_state_dict(state)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    return param.detach(), optimizer


@pytest.mark.parametrize("shape", [(6, 4), (4, 6)])  # a right and a left projection
def test_the_update_is_the_papers_algorithm(shape):
    weight, grads = torch.randn(shape, dtype=torch.float64), gradients(shape, 5)
    got, optimizer = run_galore(weight, grads)
    assert torch.allclose(got, paper_update(weight, grads), rtol=0, atol=1e-12)
    state = next(iter(optimizer.state.values()))
    assert state["exp_avg"].shape == ((6, RANK) if shape == (6, 4) else (RANK, 6)) and state["step"] == 5


def test_without_a_projection_it_is_torch_adamw():
    weight, grads = torch.randn(5, 3, dtype=torch.float64), gradients((5, 3), 4, seed=1)
    got, _ = run_galore(weight, grads, projected=False)
    param = torch.nn.Parameter(weight.clone())
    reference = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    for grad in grads:
        param.grad = grad.clone()
        reference.step()
    assert torch.allclose(got, param.detach(), rtol=0, atol=1e-12)


def test_a_checkpoint_round_trip_through_safetensors_continues_exactly(tmp_path):
    weight, grads = torch.randn(6, 4, dtype=torch.float64), gradients((6, 4), 5, seed=2)
    straight, _ = run_galore(weight, grads)
    halfway, optimizer = run_galore(weight, grads[:3])  # 3 steps: the projection of step 3 is saved
    tensors, meta = flatten_optimizer(optimizer.state_dict())
    save_file(tensors, tmp_path / "optimizer.safetensors")
    restored = unflatten_optimizer(load_file(tmp_path / "optimizer.safetensors"), meta)
    resumed, _ = run_galore(halfway, grads[3:], state=restored)
    assert torch.equal(resumed, straight)


def test_a_state_of_another_rank_is_refused():
    _, optimizer = run_galore(torch.randn(6, 4), [g.float() for g in gradients((6, 4), 1)])
    param = torch.nn.Parameter(torch.randn(6, 4))
    other = GaLoreAdamW([{"params": [param], "rank": 3, "update_interval": INTERVAL, "scale": SCALE}])
    saved = optimizer.state_dict()  # worker.resume keeps today's settings, the saved parameter indices
    saved["param_groups"] = [{**now, "params": old["params"]}
                             for now, old in zip(other.state_dict()["param_groups"], saved["param_groups"])]
    with pytest.raises(ValueError, match=r"moments have shape \(6, 2\), not \(6, 3\)"):
        other.load_state_dict(saved)


def test_state_memory_is_the_projected_size():
    _, optimizer = run_galore(torch.randn(64, 32), [g.float() for g in gradients((64, 32), 1)])
    assert state_bytes(optimizer) == 4 * (2 * 64 * RANK + RANK * 32)  # two moments and the r x n basis


@pytest.fixture(scope="module")
def tiny_examples():
    from worker.data import load_examples, sample_dataset_path, split_examples

    return split_examples(load_examples(sample_dataset_path("sql_expert")))[0][:32]


def test_a_full_parameter_trainer_learns_with_galore_and_refuses_it_with_lora(tiny_examples):
    settings = TrainSettings(lr=3e-3, batch_size=4, max_seq_len=64, optimizer=OptimizerSettings(
        "galore", GaLoreSettings(rank=8, update_interval=4, scale=1.0)))
    trainer = LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(rank=0), settings, tiny_examples)
    before = trainer.eval_loss(tiny_examples[:8])
    trainer.train_steps(6)
    assert trainer.eval_loss(tiny_examples[:8]) < before - 0.1
    projected = [s for s in trainer.optimizer_state()["state"].values() if "projection" in s]
    assert len(projected) == 7 * 2  # q, k, v, o, gate, up, down in each of tiny-qwen2's two layers
    assert all(min(s["exp_avg"].shape) == 8 for s in projected)
    with pytest.raises(ValueError, match="add --lora-rank 0"):
        LoraTrainer(load_base_model("tiny-qwen2"), LoraSettings(rank=4), settings, tiny_examples)
    assert not math.isnan(before)
