"""What the demo shows after training: held-out loss per model and domain, pass@1, answers side by side.

Every model (the base, each expert, the gateway) is evaluated once on every held-out example, one
model at a time with its adapter folded into a copy of the base weights. The routed row needs no
extra forward pass: each prompt takes the losses of the model the coordinator routes it to. The
mixture row (what serve.py's ``auto`` answers with) scores each prompt under the router's top-3
experts weighted by its probabilities, on serving's batched LoRA path (one copy of the base model
holding every adapter). For DS-1000 domains, pass@1 is DS-1000's own check: the greedy answers of
base, gateway, routed and mixture are executed with each problem's test harness in a sandbox
(gateway/sandbox.py).
"""
from __future__ import annotations

import copy
import json
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from bench.mixtures import generate_answers, mixed_losses, score_answers
from gateway.export import merged_copy
from gateway.router import mixture_weights
from serving.batched_lora import AdapterBank
from serving.choices import MIXTURE_TOP_K
from protocol.client import CoordinatorClient
from protocol.tensors import loads
from worker.data import Example, pad_token_id, prompt_token_ids
from worker.evaluation import AnswerLoss, answer_losses, total
from models.loading import BaseModel

BASE, GATEWAY, ROUTED, MIXTURE = "base model", "gateway", "routed", "mixture"
DS1000_HELDOUT = Path(__file__).resolve().parents[1] / "data" / "ds1000" / "heldout"
PASS_TOKENS = 96
"""Longest generated answer executed for pass@1."""


@dataclass(frozen=True)
class HeldOut:
    """One domain's held-out examples and the one whose answers are shown."""

    specialty: str
    examples: tuple[Example, ...]
    shown: int
    """Index into examples of the prompt answered side by side."""


@dataclass
class Report:
    losses: dict[str, dict[str, AnswerLoss]] = field(default_factory=dict)
    """model label -> specialty -> summed answer loss on that domain's held-out examples."""
    routes: dict[str, list[str]] = field(default_factory=dict)
    """specialty -> the coordinator's target (expert name or "gateway") for each held-out prompt."""
    outcomes: dict[str, list[str]] = field(default_factory=dict)
    """specialty -> right / wrong_expert / fallback for each held-out prompt."""
    mixtures: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    """specialty -> each held-out prompt's mixture weights (the router's top-3 probabilities)."""
    pass_at_1: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    """model label -> specialty -> (passed, scored) held-out problems (DS-1000 domains only)."""
    answers: dict[str, dict[str, str]] = field(default_factory=dict)
    """specialty -> {"base model": ..., "routed": ...} generated answers to the shown prompt."""

    def mean(self, label: str, specialty: str, with_end: bool = True) -> float:
        loss = self.losses[label][specialty]
        return loss.mean if with_end else loss.mean_without_end

    def to_json(self) -> dict:
        return {"loss": {label: {d: self.mean(label, d) for d in row} for label, row in self.losses.items()},
                "loss_without_end_token": {label: {d: self.mean(label, d, False) for d in row}
                                           for label, row in self.losses.items()},
                "routes": self.routes, "route_outcomes": self.outcomes, "answers": self.answers,
                "pass_at_1": {label: {d: {"passed": p, "scored": n} for d, (p, n) in row.items()}
                              for label, row in self.pass_at_1.items()}}


def shortest_prompt(examples: Sequence[Example]) -> int:
    """The held-out prompt shown side by side: the shortest, so its answers fit a short generation."""
    return min(range(len(examples)), key=lambda i: (len(examples[i].prompt), i))


def evaluate(base: BaseModel, client: CoordinatorClient, heldout: Sequence[HeldOut], *, max_seq_len: int,
             max_new_tokens: int, on_model: Callable[[str, float], None] = lambda label, seconds: None) -> Report:
    """Held-out losses of every model, the routed row, and the shown prompts' answers.

    on_model(label, seconds) is called after each model is done (for progress lines).
    """
    report = Report()
    for h in heldout:
        routes = [client.gateway.route(ex.prompt, expected=h.specialty) for ex in h.examples]
        report.routes[h.specialty] = [r["target"] for r in routes]
        report.outcomes[h.specialty] = [r["outcome"] for r in routes]
        report.mixtures[h.specialty] = [mixture_weights(r["probabilities"], MIXTURE_TOP_K) for r in routes]
    per_example: dict[str, dict[str, list[AnswerLoss]]] = {}
    experts = {e["name"]: e for e in client.experts.list()}
    bank = AdapterBank(copy.deepcopy(base.model).eval())
    for label in (BASE, *(h.specialty for h in heldout), GATEWAY):
        started = time.perf_counter()
        adapter = fetch_adapter(client, label, experts)
        if adapter is not None:
            bank.install(label, *adapter)
        model = base.model if adapter is None else merged_copy(base.model, *adapter)
        per_example[label] = {h.specialty: answer_losses(model, base.tokenizer, h.examples, max_seq_len=max_seq_len)
                              for h in heldout}
        report.losses[label] = {d: total(losses) for d, losses in per_example[label].items()}
        for h in heldout:  # answers from this model where it is the base or the routed target
            route = report.routes[h.specialty][h.shown]
            for role in [r for r, target in ((BASE, BASE), (ROUTED, _label(route))) if target == label]:
                report.answers.setdefault(h.specialty, {})[role] = generate(
                    model, base.tokenizer, h.examples[h.shown].prompt, max_new_tokens)
        del model
        on_model(label, time.perf_counter() - started)
    report.losses[ROUTED] = {h.specialty: total([per_example[_label(target)][h.specialty][i]
                                                 for i, target in enumerate(report.routes[h.specialty])])
                             for h in heldout}
    started = time.perf_counter()
    report.losses[MIXTURE] = {h.specialty: total(mixed_losses(bank, base.tokenizer, h.examples,
                                                              _mixes(report, h.specialty), max_seq_len))
                              for h in heldout}
    on_model(MIXTURE, time.perf_counter() - started)
    started = time.perf_counter()
    report.pass_at_1 = pass_at_1(bank, base.tokenizer, heldout, report)
    if report.pass_at_1:
        on_model("pass@1 (generate, then run each answer's tests)", time.perf_counter() - started)
    return report


def _mixes(report: Report, specialty: str) -> list[tuple[tuple[str, float], ...]]:
    return [tuple(w.items()) or ((GATEWAY, 1.0),) for w in report.mixtures[specialty]]


def harnesses_of(examples: Sequence[Example]) -> list[str] | None:
    """DS-1000's test harness (code_context) of each example, found by its prompt in data/ds1000/heldout/;
    None when any example is not a DS-1000 held-out problem (e.g. the sample data)."""
    by_prompt = {}
    for path in sorted(DS1000_HELDOUT.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                if "code_context" in record:
                    by_prompt[record["prompt"]] = record["code_context"]
    found = [by_prompt.get(e.prompt) for e in examples]
    return None if any(c is None for c in found) else [c for c in found if c is not None]


def pass_at_1(bank: AdapterBank, tokenizer: PreTrainedTokenizerBase, heldout: Sequence[HeldOut],
              report: Report) -> dict[str, dict[str, tuple[int, int]]]:
    """(passed, scored) per model and domain: every model's greedy answers generated together by serving's
    engine, each run with its problem's harness in a sandbox. Empty without DS-1000 harnesses."""
    contexts = {h.specialty: harnesses_of(h.examples) for h in heldout}
    if any(c is None for c in contexts.values()):
        return {}
    plan = []
    for h in heldout:
        routed = [((_label(t), 1.0),) for t in report.routes[h.specialty]]
        for label, mixes in ((BASE, [()] * len(h.examples)), (GATEWAY, [((GATEWAY, 1.0),)] * len(h.examples)),
                             (ROUTED, routed), (MIXTURE, _mixes(report, h.specialty))):
            plan += [(label, h.specialty, i, mix) for i, mix in enumerate(mixes)]
    answers = generate_answers(bank, tokenizer, [next(h for h in heldout if h.specialty == d).examples[i].prompt
                                                 for _, d, i, _ in plan], [m for *_, m in plan], PASS_TOKENS)
    passed = score_answers(answers, [contexts[d][i] for _, d, i, _ in plan])  # type: ignore[index]
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for (label, d, _, _), ok in zip(plan, passed):
        p, n = out.setdefault(label, {}).get(d, (0, 0))
        out[label][d] = (p + ok, n + 1)
    return out


def fetch_adapter(client: CoordinatorClient, label: str, experts: Mapping[str, dict]) -> tuple | None:
    """(tensors, lora config) of an expert or the gateway; None for the base model."""
    if label == BASE:
        return None
    if label == GATEWAY:
        return loads(client.gateway.weights("safetensors")), client.gateway.info()["lora"]
    return client.experts.pull(label).tensors, experts[label]["lora"]


def _label(target: str) -> str:
    return GATEWAY if target == "gateway" else target


@torch.no_grad()
def generate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: str, max_new_tokens: int) -> str:
    """The model's greedy answer to the prompt as a chat turn (at most max_new_tokens tokens)."""
    ids = torch.tensor([prompt_token_ids(tokenizer, prompt)])
    # GenerationMixin.generate (every *ForCausalLM has it); mypy resolves it through torch's Module.__getattr__ (a
    # Tensor), as in gateway/generate.py: transformers 5's PreTrainedModel is no GenerationMixin by itself
    out = model.generate(ids, attention_mask=torch.ones_like(ids),  # type: ignore[operator]
                         max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=pad_token_id(tokenizer))
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert isinstance(text, str)  # one sequence of ids decodes to one string (a batch would give a list)
    return text


def print_tables(report: Report, versions: Mapping[str, int]) -> None:
    specialties = list(report.routes)
    for with_end, title in ((True, "held-out answer-token loss, end-of-answer token included (lower is better)"),
                            (False, "the same without the end-of-answer token (what the answers' text costs)")):
        print(f"\n{title}\n")
        print(f"{'model':<20}" + "".join(f"{d:>16}" for d in specialties))
        for label in report.losses:
            suffix = f" v{versions[label]}" if label in versions else ""
            print(f"{label + suffix:<20}" + "".join(f"{report.mean(label, d, with_end):>16.4f}" for d in specialties))
    for d in specialties:
        outcomes = report.outcomes[d]
        print(f"\nrouter: {outcomes.count('right')} of {len(outcomes)} {d} prompts to {d}, "
              f"{outcomes.count('wrong_expert')} to another domain's expert, {outcomes.count('fallback')} to the "
              "gateway", end="")
    print()
    if report.pass_at_1:
        print(f"\npass@1: DS-1000's own test of each greedy answer (<= {PASS_TOKENS} tokens), run in a sandbox\n")
        print(f"{'model':<20}" + "".join(f"{d:>16}" for d in specialties))
        for label, row in report.pass_at_1.items():
            print(f"{label:<20}" + "".join(f"{f'{row[d][0]}/{row[d][1]}':>16}" for d in specialties))
        print("(a 135M model fine-tuned for minutes passes few of these: the loss tables show what it learnt; "
              "this shows how far that is from working code)")


def own_domain_gains(report: Report) -> dict[str, float]:
    """Base loss minus the expert's loss on the expert's own domain (positive: the expert is better)."""
    return {d: report.mean(BASE, d) - report.mean(d, d) for d in report.routes}


def print_answers(report: Report, heldout: Sequence[HeldOut], width: int = 48) -> None:
    """For each domain, the shown prompt's reference, then the base and routed answers in two columns."""
    for h in heldout:
        example = h.examples[h.shown]
        answers = report.answers[h.specialty]
        routed_to = report.routes[h.specialty][h.shown]
        question = " ".join(example.prompt.replace("Problem:", "").split())
        print(f"\n=== {h.specialty}: {textwrap.shorten(question, 150)}")
        print("reference: " + textwrap.shorten(" ".join(example.reference_code.split()), 120))
        left, right = _wrap(answers[BASE], width), _wrap(answers[ROUTED], width)
        print(f"{'base model':<{width}} | routed to {routed_to}")
        print(f"{'-' * width}-+-{'-' * width}")
        for i in range(max(len(left), len(right))):
            print(f"{left[i] if i < len(left) else '':<{width}} | {right[i] if i < len(right) else ''}")


def _wrap(text: str, width: int) -> list[str]:
    lines = []
    for line in text.strip("\n").splitlines() or [""]:
        lines += textwrap.wrap(line.replace("\t", "    "), width, drop_whitespace=False) or [""]
    return lines
