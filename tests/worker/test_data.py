"""worker.data: JSONL parsing, the held-out split, answer-only labels, batching and its position."""
import hashlib
import json
import random

import pytest
import torch

from worker.data import (IGNORE_INDEX, BatchStream, DatasetError, Example, StreamPosition, collate, encode_example,
                         load_examples, prompt_token_ids, sample_dataset_path, split_examples)
from models.presets import PRESETS, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(PRESETS["tiny-qwen2"])


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def record(prompt="Write x", answer="x = 1", **extra):
    return json.dumps({"prompt": prompt, "reference_code": answer, **extra})


# --- loading ---------------------------------------------------------------------------------

def test_load_examples_reads_fields_skips_blank_lines_and_ignores_other_keys(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [record("p1", "a1", id=7), "", "   ", record("p2", "a2")])
    assert load_examples(path) == [Example("p1", "a1"), Example("p2", "a2")]


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "line 3: not valid JSON"),
    ("[1, 2]", "line 3: expected a JSON object, got list"),
    (json.dumps({"prompt": "p"}), 'line 3: missing "reference_code"'),
    (json.dumps({"reference_code": "a"}), 'line 3: missing "prompt"'),
    (json.dumps({"prompt": "p", "reference_code": "  "}), 'line 3: "reference_code" is empty'),
    (json.dumps({"prompt": 5, "reference_code": "a"}), 'line 3: "prompt" must be a string, got int'),
])
def test_bad_line_names_file_and_line_number(tmp_path, bad_line, message):
    # line 2 is blank: numbering counts physical lines, as an editor shows them
    path = write_lines(tmp_path / "x.jsonl", [record(), "", bad_line, record()])
    with pytest.raises(DatasetError) as info:
        load_examples(path)
    assert str(info.value).startswith(f"{path} {message}")


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_is_an_error(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match="no examples"):
        load_examples(path)


def test_missing_file_is_a_dataset_error(tmp_path):
    with pytest.raises(DatasetError, match="cannot read"):
        load_examples(tmp_path / "absent.jsonl")


def test_sample_dataset_path():
    assert sample_dataset_path("sql_expert").name == "sql_expert.jsonl"
    assert sample_dataset_path("no_such_expert") is None
    assert sample_dataset_path("../data/sql_expert") is None


# --- split ----------------------------------------------------------------------------------

def make_examples(n):
    return [Example(f"task number {i}", f"answer {i}") for i in range(n)]


def test_split_is_independent_of_order_and_partitions_the_examples():
    examples = make_examples(500)
    train, heldout = split_examples(examples, 0.1)
    shuffled = examples[:]
    random.Random(3).shuffle(shuffled)
    train2, heldout2 = split_examples(shuffled, 0.1)
    assert set(heldout) == set(heldout2) and set(train) == set(train2)
    assert set(train) | set(heldout) == set(examples) and not set(train) & set(heldout)
    assert 30 <= len(heldout) <= 70  # sha1 is uniform: 10% of 500 give or take sampling noise
    assert train == [ex for ex in examples if ex in set(train)]  # input order kept


def test_split_membership_is_fixed_by_the_prompt_text():
    train, heldout = split_examples(make_examples(40), 0.1)
    by_hash = [ex.prompt for ex in make_examples(40)
               if int(hashlib.sha1(ex.prompt.encode()).hexdigest()[:16], 16) / 2 ** 64 < 0.1]
    assert [ex.prompt for ex in heldout] == by_hash
    # Pinned: sha1 is the same on every machine and Python version, so this list never changes.
    assert by_hash == ["task number 5", "task number 21", "task number 24", "task number 33"]


def test_split_holds_out_at_least_one_and_keeps_at_least_one():
    for n in (2, 3, 5):
        train, heldout = split_examples(make_examples(n), 0.1)
        assert len(heldout) >= 1 and len(train) >= 1
    train, heldout = split_examples(make_examples(2), 0.99)
    assert len(train) == 1 and len(heldout) == 1
    assert split_examples(make_examples(1), 0.1) == (make_examples(1), [])
    assert split_examples(make_examples(5), 0.0) == (make_examples(5), [])


def test_duplicate_prompts_land_on_the_same_side():
    examples = make_examples(200) + [Example("task number 7", "another answer")]
    train, heldout = split_examples(examples)
    prompts_train, prompts_held = {e.prompt for e in train}, {e.prompt for e in heldout}
    assert not prompts_train & prompts_held


def test_split_rejects_bad_fraction():
    with pytest.raises(ValueError, match="1.0"):
        split_examples(make_examples(3), 1.0)


# --- encoding ---------------------------------------------------------------------------------

def test_labels_mask_the_prompt_and_copy_the_answer(tokenizer):
    example = Example("Write a query that lists departments.", "SELECT name FROM departments;")
    ids, labels = encode_example(tokenizer, example, max_seq_len=256)
    prompt = prompt_token_ids(tokenizer, example.prompt)
    answer = tokenizer(example.reference_code, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ids == prompt + answer
    assert labels[:len(prompt)] == [IGNORE_INDEX] * len(prompt)
    assert labels[len(prompt):] == ids[len(prompt):] == answer
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(
        [{"role": "user", "content": example.prompt}, {"role": "assistant", "content": example.reference_code}],
        tokenize=False).rstrip("\n")
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_truncation_keeps_prompt_tail_and_answer_head(tokenizer):
    example = Example("describe " * 200 + "THE END", "line\n" * 300)
    prompt = prompt_token_ids(tokenizer, example.prompt)
    answer = tokenizer(example.reference_code, add_special_tokens=False)["input_ids"]
    ids, labels = encode_example(tokenizer, example, max_seq_len=64)
    n_prompt = labels.count(IGNORE_INDEX)
    assert len(ids) == 64 and n_prompt == 32
    assert ids[:n_prompt] == prompt[-n_prompt:]  # the prompt's tail, ending in the assistant header
    assert ids[n_prompt:] == labels[n_prompt:] == answer[:64 - n_prompt]  # the answer's head


def test_short_answer_is_kept_whole_when_prompt_is_long(tokenizer):
    example = Example("word " * 500, "x = 1")
    ids, labels = encode_example(tokenizer, example, max_seq_len=40)
    answer = tokenizer("x = 1", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert len(ids) == 40 and ids[-len(answer):] == answer and labels[-len(answer):] == answer


def test_tiny_window_still_has_an_answer_token(tokenizer):
    ids, labels = encode_example(tokenizer, Example("long prompt " * 50, "long answer " * 50), max_seq_len=2)
    assert len(ids) == 2 and labels[0] == IGNORE_INDEX and labels[1] == ids[1]


# --- batching ---------------------------------------------------------------------------------

def test_collate_pads_right_with_masked_labels():
    batch = collate([([5, 6, 7], [IGNORE_INDEX, 6, 7]), ([9], [9])], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert batch.labels.tolist() == [[IGNORE_INDEX, 6, 7], [9, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.num_tokens == 4 and batch.num_samples == 2


def fake_encoded(n):
    return [([i, i], [i, i]) for i in range(n)]


def first_tokens(batch):
    return batch.input_ids[:, 0].tolist()


def test_stream_visits_every_example_once_per_epoch_in_a_seeded_order():
    stream = BatchStream(fake_encoded(10), 4, seed=1, pad_id=0)
    epoch0 = [first_tokens(next(stream)) for _ in range(3)]
    assert [len(b) for b in epoch0] == [4, 4, 2]  # batches never span epochs
    assert sorted(sum(epoch0, [])) == list(range(10))
    assert stream.position == StreamPosition(1, 0)
    epoch1 = sum((first_tokens(next(stream)) for _ in range(3)), [])
    assert sorted(epoch1) == list(range(10)) and epoch1 != sum(epoch0, [])
    again = BatchStream(fake_encoded(10), 4, seed=1, pad_id=0)
    assert [first_tokens(next(again)) for _ in range(3)] == epoch0
    other = BatchStream(fake_encoded(10), 4, seed=2, pad_id=0)
    assert [first_tokens(next(other)) for _ in range(3)] != epoch0


def test_stream_resumes_from_a_saved_position():
    stream = BatchStream(fake_encoded(10), 3, seed=5, pad_id=0)
    for _ in range(5):
        next(stream)
    saved = StreamPosition.from_dict(json.loads(json.dumps(stream.position.to_dict())))
    expected = [first_tokens(next(stream)) for _ in range(6)]
    resumed = BatchStream(fake_encoded(10), 3, seed=5, pad_id=0, position=saved)
    assert [first_tokens(next(resumed)) for _ in range(6)] == expected


def test_stream_rejects_bad_input():
    with pytest.raises(ValueError):
        BatchStream([], 2, seed=0, pad_id=0)
    with pytest.raises(ValueError):
        BatchStream(fake_encoded(3), 2, seed=0, pad_id=0, position=StreamPosition(0, 3))
    assert isinstance(collate(fake_encoded(2), 0).input_ids, torch.Tensor)
