"""The generation engine on tiny-qwen2: rows of mixed adapters, mixtures, joining and leaving a running
batch, each answer as the adapter alone would give it."""
import time

import pytest
import torch

from gateway.generate import generate as reference_answer
from serving.adapters import AdapterRegistry, LoadedAdapter
from serving.config import EngineOptions
from serving.engine import BASE_SLOT, AdapterWeights, GenerationEngine
from serving.jobs import END, START, TEXT, Job
from serving.schema import CompletionRequest, Sampling
from models.loading import load_base_model

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
PROMPT = "Write a function that sorts a list"
TOKENS = 8


def adapter(model, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "v_proj")):
            out[f"base_model.model.{name}.lora_A.weight"] = torch.randn(4, module.in_features, generator=g) * 0.3
            out[f"base_model.model.{name}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=g) * 0.3
    return out


def half_and_half(a: dict, b: dict) -> dict:
    """The rank-8 adapter equal to 0.5 * a + 0.5 * b (ranks concatenated, B halved; the scale stays 2)."""
    out = {}
    for key in a:
        out[key] = torch.cat([a[key], b[key]]) if "lora_A" in key else 0.5 * torch.cat([a[key], b[key]], dim=1)
    return out


@pytest.fixture(scope="module")
def reference():
    base = load_base_model("tiny-qwen2")
    adapters = {name: adapter(base.model, seed) for seed, name in enumerate(["a", "b"])}
    answers = {name: reference_answer(base.model, base.tokenizer, PROMPT, t, LORA, max_new_tokens=TOKENS)
               for name, t in adapters.items()}
    answers["base"] = reference_answer(base.model, base.tokenizer, PROMPT, max_new_tokens=TOKENS)
    answers["mix"] = reference_answer(base.model, base.tokenizer, PROMPT, half_and_half(adapters["a"], adapters["b"]),
                                      {**LORA, "rank": 8, "alpha": 16.0}, max_new_tokens=TOKENS)
    return answers, adapters


def new_engine(adapters, max_batch: int = 8) -> tuple[GenerationEngine, AdapterRegistry, list[int]]:
    base = load_base_model("tiny-qwen2")
    registry = AdapterRegistry()
    engine = GenerationEngine(base.model, base.tokenizer, registry, EngineOptions(max_batch=max_batch))
    for name, tensors in adapters.items():
        engine.install(AdapterWeights(name, 0, tensors, LORA)).result()  # not started: runs here
    prompt_ids = base.tokenizer(base.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    return engine, registry, prompt_ids


def job_for(model: str, registry: AdapterRegistry, prompt_ids: list[int], max_tokens: int = TOKENS,
            sampling: Sampling = Sampling(temperature=0)) -> Job:
    request = CompletionRequest("chat", model, ({"role": "user", "content": PROMPT},), None, max_tokens,
                                sampling, (), False, False)
    if model == "base":
        return Job(request, prompt_ids, LoadedAdapter("base", BASE_SLOT, 0, 0), time.monotonic() + 60)
    if model == "mix":
        a, b = registry.pin("a"), registry.pin("b")
        return Job(request, prompt_ids, a, time.monotonic() + 60, mixture=((a, 0.5), (b, 0.5)))
    return Job(request, prompt_ids, registry.pin(model), time.monotonic() + 60)


def text_of(job: Job) -> str:
    events = [job.events.get(timeout=60)]
    while events[-1][0] != END:
        events.append(job.events.get(timeout=60))
    assert events[0][0] == START
    return "".join(v for k, v in events if k == TEXT)


def test_one_batch_of_two_adapters_a_mixture_and_the_base_model_answers_as_each_alone(reference):
    answers, adapters = reference
    assert len({answers[k] for k in ("a", "b", "base", "mix")}) == 4  # each row really differs
    engine, registry, prompt_ids = new_engine(adapters)
    models = ["a", "b", "base", "mix", "b", "a"]
    jobs = [job_for(m, registry, prompt_ids) for m in models]
    for job in jobs:
        engine.submit(job)  # all queued before the thread starts: one prefill, then decode steps of 6 rows
    engine.start()
    texts = [text_of(job) for job in jobs]
    engine.stop()
    assert texts == [answers[m] for m in models]
    assert engine.batches[6] >= TOKENS - 1 and set(engine.batches) <= {6}
    assert all(a.users == 0 for a in registry.names())  # every pin released, the mixture's two as well


def test_a_request_joins_a_running_batch_and_answers_as_alone(reference):
    answers, adapters = reference
    engine, registry, prompt_ids = new_engine(adapters)
    first = job_for("a", registry, prompt_ids, max_tokens=24)
    engine.start()
    engine.submit(first)
    while first.first_token_at is None or len(first.tokens) < 3:  # first is mid-generation
        time.sleep(0.001)
    second = job_for("b", registry, prompt_ids)
    engine.submit(second)
    assert text_of(second) == answers["b"]
    assert text_of(first).startswith(answers["a"])
    engine.stop()
    assert second.first_token_at is not None and first.finished
    assert engine.batches[2] >= 1  # the two shared decode steps


def test_a_tiny_temperature_answers_as_greedy_decoding(reference):
    """Issue 30, 4: a temperature of 1e-45 reached sampling, whose probabilities were NaN: the batch failed (500)."""
    answers, adapters = reference
    engine, registry, prompt_ids = new_engine(adapters)
    job = job_for("a", registry, prompt_ids, sampling=Sampling(temperature=1e-45, top_p=0.9))
    engine.submit(job)
    engine.start()
    assert text_of(job) == answers["a"]  # the greedy answer (was: FAILED, no END)
    engine.stop()


def test_a_new_version_is_published_and_the_old_slot_dropped_after_its_last_request(reference):
    _, adapters = reference
    engine, registry, _ = new_engine({})
    first = engine.install(AdapterWeights("a", 0, adapters["a"], LORA)).result()
    held = registry.pin("a")
    second = engine.install(AdapterWeights("a", 1, adapters["b"], LORA)).result()
    assert registry.get("a") is second and held is first
    engine._do_tasks()
    assert first.slot in engine.bank.ranks  # still pinned: kept
    registry.unpin(held)
    engine._do_tasks()
    assert first.slot not in engine.bank.ranks and second.slot in engine.bank.ranks
    assert all(first.slot not in layer.factors for layer in engine.bank.layers.values())


def test_an_adapter_that_does_not_fit_is_refused_and_nothing_is_published(reference):
    _, adapters = reference
    engine, registry, _ = new_engine({})
    wrong = {k: torch.zeros(v.shape[0], v.shape[1] + 1) if "lora_A" in k else v for k, v in adapters["a"].items()}
    with pytest.raises(ValueError, match="another base model"):
        engine.install(AdapterWeights("a", 0, wrong, LORA)).result()
    assert registry.get("a") is None and not engine.bank.ranks
    assert all(not layer.factors for layer in engine.bank.layers.values())
