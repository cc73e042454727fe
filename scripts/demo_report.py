"""What the demo shows after training: held-out loss per model and domain, and answers side by side.

Every model (the base, each expert, the gateway) is evaluated once on every held-out example, one
model at a time with its adapter folded into a copy of the base weights. The routed row needs no
extra forward pass: each prompt takes the losses of the model the coordinator routes it to.
"""
from __future__ import annotations

import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gateway.export import merged_copy
from protocol.client import CoordinatorClient
from protocol.tensors import loads
from worker.data import Example, pad_token_id, prompt_token_ids
from worker.evaluation import AnswerLoss, answer_losses, total
from worker.models import BaseModel

BASE, GATEWAY, ROUTED = "base model", "gateway", "routed"


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
    answers: dict[str, dict[str, str]] = field(default_factory=dict)
    """specialty -> {"base model": ..., "routed": ...} generated answers to the shown prompt."""

    def mean(self, label: str, specialty: str, with_end: bool = True) -> float:
        loss = self.losses[label][specialty]
        return loss.mean if with_end else loss.mean_without_end

    def to_json(self) -> dict:
        return {"loss": {label: {d: self.mean(label, d) for d in row} for label, row in self.losses.items()},
                "loss_without_end_token": {label: {d: self.mean(label, d, False) for d in row}
                                           for label, row in self.losses.items()},
                "routes": self.routes, "answers": self.answers}


def shortest_prompt(examples: Sequence[Example]) -> int:
    """The held-out prompt shown side by side: the shortest, so its answers fit a short generation."""
    return min(range(len(examples)), key=lambda i: (len(examples[i].prompt), i))


def evaluate(base: BaseModel, client: CoordinatorClient, heldout: Sequence[HeldOut], *, max_seq_len: int,
             max_new_tokens: int, on_model: Callable[[str, float], None] = lambda label, seconds: None) -> Report:
    """Held-out losses of every model, the routed row, and the shown prompts' answers.

    on_model(label, seconds) is called after each model is done (for progress lines).
    """
    report = Report(routes={h.specialty: [client.route(ex.prompt)["target"] for ex in h.examples] for h in heldout})
    per_example: dict[str, dict[str, list[AnswerLoss]]] = {}
    experts = {e["name"]: e for e in client.list_experts()}
    for label in (BASE, *(h.specialty for h in heldout), GATEWAY):
        started = time.perf_counter()
        adapter = fetch_adapter(client, label, experts)
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
    return report


def fetch_adapter(client: CoordinatorClient, label: str, experts: Mapping[str, dict]) -> tuple | None:
    """(tensors, lora config) of an expert or the gateway; None for the base model."""
    if label == BASE:
        return None
    if label == GATEWAY:
        return loads(client.gateway_weights("safetensors")), client.gateway_info()["lora"]
    return client.pull_weights(label).tensors, experts[label]["lora"]


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
        targets = report.routes[d]
        print(f"\nrouter: {targets.count(d)} of {len(targets)} {d} prompts to {d}, "
              f"{targets.count('gateway')} to the gateway", end="")
    print()


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
