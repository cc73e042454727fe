"""The generation engine on tiny-qwen2: batches of mixed adapters answer as each adapter alone would."""
import time

import pytest
import torch

from gateway.generate import generate as reference_answer
from serving.adapters import AdapterRegistry
from serving.config import EngineOptions
from serving.engine import AdapterWeights, GenerationEngine
from serving.jobs import END, START, TEXT, Job
from serving.schema import CompletionRequest, Sampling
from worker.models import load_base_model

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
PROMPT = "Write a function that sorts a list"


def adapter(model, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "v_proj")):
            out[f"base_model.model.{name}.lora_A.weight"] = torch.randn(4, module.in_features, generator=g) * 0.3
            out[f"base_model.model.{name}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=g) * 0.3
    return out


@pytest.fixture(scope="module")
def reference():
    base = load_base_model("tiny-qwen2")
    adapters = {name: adapter(base.model, seed) for seed, name in enumerate(["a", "b"])}
    return {name: reference_answer(base.model, base.tokenizer, PROMPT, t, LORA, max_new_tokens=8)
            for name, t in adapters.items()}, adapters


def run(jobs: list[Job], mix: bool, adapters, sampling: Sampling = Sampling(temperature=0)) -> tuple[list[str],
                                                                                                 GenerationEngine]:
    base = load_base_model("tiny-qwen2")
    registry = AdapterRegistry()
    engine = GenerationEngine(base.model, base.tokenizer, registry, EngineOptions(max_batch=8, mix_adapters=mix))
    for name, tensors in adapters.items():
        engine.install(AdapterWeights(name, 0, tensors, LORA)).result()  # not started: runs here
    prompt_ids = base.tokenizer(base.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    pinned = []
    for model in jobs:
        request = CompletionRequest("chat", model, ({"role": "user", "content": PROMPT},), None, 8,
                                    sampling, (), False, False)
        pinned.append(Job(request, prompt_ids, registry.pin(model), time.monotonic() + 60))
    for job in pinned:
        engine.submit(job)  # all queued before the thread starts: they make one batch
    engine.start()
    texts = []
    for job in pinned:
        events = [job.events.get(timeout=60)]
        while events[-1][0] != END:
            events.append(job.events.get(timeout=60))
        assert events[0][0] == START
        texts.append("".join(v for k, v in events if k == TEXT))
    engine.stop()
    return texts, engine


@pytest.mark.parametrize("mix", [True, False])
def test_a_batch_of_two_adapters_answers_as_each_alone(reference, mix):
    answers, adapters = reference
    assert answers["a"] != answers["b"]
    texts, engine = run(["a", "b", "a", "b"], mix, adapters)
    assert texts == [answers["a"], answers["b"], answers["a"], answers["b"]]
    assert engine.batches == ({4: 1} if mix else {2: 2})


def test_a_tiny_temperature_answers_as_greedy_decoding(reference):
    """Issue 30, 4: a temperature of 1e-45 reached sampling, whose probabilities were NaN: the batch failed (500)."""
    answers, adapters = reference
    texts, _ = run(["a"], False, {"a": adapters["a"]}, Sampling(temperature=1e-45, top_p=0.9))
    assert texts == [answers["a"]]  # the greedy answer (was: FAILED, no END)


def test_a_new_version_is_published_and_the_old_slot_dropped_after_its_last_request(reference):
    _, adapters = reference
    base = load_base_model("tiny-qwen2")
    registry = AdapterRegistry()
    engine = GenerationEngine(base.model, base.tokenizer, registry)
    first = engine.install(AdapterWeights("a", 0, adapters["a"], LORA)).result()
    held = registry.pin("a")
    second = engine.install(AdapterWeights("a", 1, adapters["b"], LORA)).result()
    assert registry.get("a") is second and held is first
    engine._do_tasks()
    assert first.slot in engine.model.peft_config  # still pinned: kept
    registry.unpin(held)
    engine._do_tasks()
    assert first.slot not in engine.model.peft_config and second.slot in engine.model.peft_config


def test_an_adapter_that_does_not_fit_is_refused_and_nothing_is_published(reference):
    _, adapters = reference
    base = load_base_model("tiny-qwen2")
    registry = AdapterRegistry()
    engine = GenerationEngine(base.model, base.tokenizer, registry)
    wrong = {k: torch.zeros(v.shape[0] + 1, v.shape[1]) if "lora_A" in k else v for k, v in adapters["a"].items()}
    with pytest.raises(Exception):
        engine.install(AdapterWeights("a", 0, wrong, LORA)).result()
    assert registry.get("a") is None
