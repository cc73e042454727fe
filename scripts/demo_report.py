"""What the demo shows after training: held-out loss per model and domain, pass@1, answers side by side.

Every model (the base, each expert, the gateway) is evaluated once on every held-out example, one
model at a time with its adapter folded into a copy of the base weights. The routed row needs no
extra forward pass: each prompt takes the losses of the model the coordinator routes it to. The
mixture row (what serve.py's ``auto`` answers with) scores each prompt under the router's top-3
experts weighted by its probabilities, on serving's batched LoRA path (one copy of the base model
holding every adapter). For DS-1000 domains, pass@1 is DS-1000's own check: the greedy answers of
base, gateway, routed and mixture are executed with each problem's test harness in a sandbox
(gateway/sandbox.py). Spider's databases are not shipped, so SQL answers get no pass@1; they get a
weaker check instead: whether the answer compiles as a read-only query on its database's schema
(gateway/sql_check.py: syntax and names right, not the result).
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
from gateway.sql_check import check_sql
from gateway.router import mixture_weights
from serving.batched_lora import AdapterBank
from serving.choices import MIXTURE_TOP_K
from protocol.client import CoordinatorClient
from protocol.tensors import loads
from worker.data import Example, pad_token_id, prompt_token_ids
from worker.evaluation import AnswerLoss, answer_losses, total
from models.loading import BaseModel

BASE, GATEWAY, ROUTED, MIXTURE = "base model", "gateway", "routed", "mixture"
DATA = Path(__file__).resolve().parents[1] / "data"
DS1000_HELDOUT = DATA / "ds1000" / "heldout"
SPIDER_HELDOUT = DATA / "spider" / "heldout"
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
    sql_compiles: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    """model label -> specialty -> (compiled, scored) held-out SQL answers (Spider domains only; not correctness)."""
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
                              for label, row in self.pass_at_1.items()},
                "sql_compiles": {label: {d: {"compiled": p, "scored": n} for d, (p, n) in row.items()}
                                 for label, row in self.sql_compiles.items()}}


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
    report.pass_at_1, report.sql_compiles = check_answers(bank, base.tokenizer, heldout, report)
    if report.pass_at_1 or report.sql_compiles:
        on_model("pass@1 and SQL check (generate, then check each answer)", time.perf_counter() - started)
    return report


def _mixes(report: Report, specialty: str) -> list[tuple[tuple[str, float], ...]]:
    return [tuple(w.items()) or ((GATEWAY, 1.0),) for w in report.mixtures[specialty]]


def _held_out_field(examples: Sequence[Example], directory: Path, key: str) -> list[str] | None:
    """Each example's ``key`` from the held-out records in ``directory``, found by its prompt; None when any
    example is not among them."""
    by_prompt = {}
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                if key in record:
                    by_prompt[record["prompt"]] = record[key]
    found = [by_prompt.get(e.prompt) for e in examples]
    return None if any(c is None for c in found) else [c for c in found if c is not None]


def harnesses_of(examples: Sequence[Example]) -> list[str] | None:
    """DS-1000's test harness (code_context) of each example, found by its prompt in data/ds1000/heldout/;
    None when any example is not a DS-1000 held-out problem (e.g. the sample data)."""
    return _held_out_field(examples, DS1000_HELDOUT, "code_context")


def schemas_of(examples: Sequence[Example]) -> list[str] | None:
    """The CREATE TABLE statements of each example's database, found by its prompt in data/spider/heldout/;
    None when any example is not a Spider held-out question."""
    return _held_out_field(examples, SPIDER_HELDOUT, "schema_sql")


Tally = dict[str, dict[str, tuple[int, int]]]
"""model label -> specialty -> (passed, scored)."""


def check_answers(bank: AdapterBank, tokenizer: PreTrainedTokenizerBase, heldout: Sequence[HeldOut],
                  report: Report) -> tuple[Tally, Tally]:
    """(pass@1 of the DS-1000 domains, compiled SQL answers of the Spider domains) per model and domain.

    Every model's greedy answers are generated together by serving's engine; a DS-1000 answer runs with
    its problem's harness in a sandbox, a SQL answer is compiled on its database's schema. A domain with
    neither (the sample data) is not generated for.
    """
    harnesses = {h.specialty: c for h in heldout if (c := harnesses_of(h.examples)) is not None}
    schemas = {h.specialty: s for h in heldout if h.specialty not in harnesses
               and (s := schemas_of(h.examples)) is not None}
    checked = [h for h in heldout if h.specialty in harnesses or h.specialty in schemas]
    plan = []
    for h in checked:
        routed = [((_label(t), 1.0),) for t in report.routes[h.specialty]]
        for label, mixes in ((BASE, [()] * len(h.examples)), (GATEWAY, [((GATEWAY, 1.0),)] * len(h.examples)),
                             (ROUTED, routed), (MIXTURE, _mixes(report, h.specialty))):
            plan += [(label, h.specialty, i, mix) for i, mix in enumerate(mixes)]
    if not plan:
        return {}, {}
    answers = generate_answers(bank, tokenizer, [next(h for h in heldout if h.specialty == d).examples[i].prompt
                                                 for _, d, i, _ in plan], [m for *_, m in plan], PASS_TOKENS)
    runs = [(k, a) for k, a in zip(plan, answers) if k[1] in harnesses]
    passed = score_answers([a for _, a in runs], [harnesses[d][i] for (_, d, i, _), _ in runs])
    compiled = [check_sql(schemas[d][i], a).compiles for (_, d, i, _), a in zip(plan, answers) if d in schemas]
    return (_tally([k for k, _ in runs], passed),
            _tally([k for k in plan if k[1] in schemas], compiled))


def _tally(plan: Sequence[tuple[str, str, int, object]], ok: Sequence[bool]) -> Tally:
    out: Tally = {}
    for (label, d, _, _), good in zip(plan, ok):
        p, n = out.setdefault(label, {}).get(d, (0, 0))
        out[label][d] = (p + good, n + 1)
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
    print_answer_checks(report, specialties)


def print_answer_checks(report: Report, specialties: Sequence[str]) -> None:
    """pass@1 (DS-1000 domains) and compiled SQL (Spider domains) in one table; "n/a" where a check does not apply."""
    labels = list(report.pass_at_1) or list(report.sql_compiles)
    if not labels:
        return
    print(f"\npass@1: DS-1000's own test of each greedy answer (<= {PASS_TOKENS} tokens), run in a sandbox"
          + ("; for SQL, whether the query compiles on its database's schema (not whether it is right)"
             if report.sql_compiles else "") + "\n")
    print(f"{'model':<20}" + "".join(f"{d:>16}" for d in specialties))
    for label in labels:
        cells = []
        for d in specialties:
            p, n = report.pass_at_1.get(label, {}).get(d) or report.sql_compiles.get(label, {}).get(d) or (0, 0)
            cells.append(f"{p}/{n}" if n else "n/a")
        print(f"{label:<20}" + "".join(f"{c:>16}" for c in cells))
    if report.pass_at_1:
        print("(a 135M model fine-tuned for minutes passes few of these: the loss tables show what it learnt; "
              "this shows how far that is from working code)")
    if report.sql_compiles:
        print("(sql: Spider's databases are not shipped, so no execution accuracy; a query that compiles on the "
              "schema has valid syntax and names only existing tables and columns, and can still be wrong)")


def own_domain_gains(report: Report) -> dict[str, float]:
    """Base loss minus the expert's loss on the expert's own domain (positive: the expert is better)."""
    return {d: report.mean(BASE, d) - report.mean(d, d) for d in report.routes}


def print_answers(report: Report, heldout: Sequence[HeldOut], width: int = 48) -> None:
    """For each domain, the shown prompt's reference, then the base and routed answers in two columns."""
    for h in heldout:
        example = h.examples[h.shown]
        answers = report.answers[h.specialty]
        routed_to = report.routes[h.specialty][h.shown]
        shown = example.prompt.rsplit("\nQuestion: ", 1)[-1]  # a Spider prompt: its question, not its schema
        question = " ".join(shown.replace("Problem:", "").split())
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
