"""Turning generated tokens into streamed text: stop tokens, stop sequences across tokens, limits."""
import time

import pytest

from serving.adapters import AdapterRegistry, LoadedAdapter
from serving.errors import ModelNotFound
from serving.jobs import END, TEXT, Job
from serving.schema import CompletionRequest, Sampling
from models.presets import build_tokenizer, PRESETS

EOS = 10**6


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(PRESETS["tiny-qwen2"])


def job(max_tokens=50, stop=(), deadline=None) -> Job:
    request = CompletionRequest("text", "m", None, "p", max_tokens, Sampling(), tuple(stop), False, False)
    return Job(request, [1, 2], LoadedAdapter("m", "slot1", 0, 4), deadline or time.monotonic() + 60)


def feed(j: Job, tokenizer, text: str) -> None:
    for token in tokenizer(text)["input_ids"]:
        j.accept(token, tokenizer, frozenset({EOS}))


def events(j: Job) -> list:
    out = []
    while not j.events.empty():
        out.append(j.events.get_nowait())
    return out


def test_text_arrives_in_pieces_that_add_up_and_ends_at_the_stop_token(tokenizer):
    j = job()
    feed(j, tokenizer, "SELECT name FROM users")
    j.accept(EOS, tokenizer, frozenset({EOS}))
    got = events(j)
    assert "".join(v for k, v in got if k == TEXT) == "SELECT name FROM users"
    assert got[-1] == (END, "stop") and j.finish_reason == "stop"
    j.accept(5, tokenizer, frozenset({EOS}))  # tokens after the end (padding rows) are ignored
    assert events(j) == [] and len(j.tokens) == len(tokenizer("SELECT name FROM users")["input_ids"])


def test_a_stop_sequence_spanning_tokens_is_cut_and_never_sent(tokenizer):
    j = job(stop=["FROM"])
    feed(j, tokenizer, "SELECT name FROM users")
    got = events(j)
    assert "".join(v for k, v in got if k == TEXT) == "SELECT name "
    assert got[-1] == (END, "stop")


def test_max_tokens_ends_with_length(tokenizer):
    j = job(max_tokens=2)
    feed(j, tokenizer, "one two three four five")
    assert len(j.tokens) == 2 and j.finish_reason == "length"


def test_a_passed_deadline_ends_with_length(tokenizer):
    j = job(deadline=time.monotonic() - 1)
    feed(j, tokenizer, "one two")
    assert len(j.tokens) == 1 and j.finish_reason == "length"


def test_a_cancelled_job_stops_at_its_next_token(tokenizer):
    j = job()
    feed(j, tokenizer, "one")
    j.cancelled = True
    feed(j, tokenizer, " two")
    assert j.finish_reason == "cancelled"


def test_pinned_adapters_are_dropped_only_after_their_last_request():
    registry = AdapterRegistry()
    v0 = LoadedAdapter("e", registry.new_slot(), 0, 4)
    registry.publish(v0)
    held = registry.pin("e")
    v1 = LoadedAdapter("e", registry.new_slot(), 1, 4)
    registry.publish(v1)
    assert held is v0 and registry.pin("e") is v1 and v0.slot != v1.slot
    assert registry.reapable() == []  # v0 still answers a request
    registry.unpin(held)
    assert registry.reapable() == [v0] and registry.reapable() == []
    with pytest.raises(ModelNotFound) as caught:
        registry.pin("nope")
    assert caught.value.status == 404 and "e" in caught.value.message
