"""worker.datasets and the tokenisation of every format: detection, each reader, the containers `datasets`
reads (CSV, JSON, Parquet, save_to_disk), multi-turn labels checked token by token against the chat
template, packed plain text, --split-key groups, the near-duplicate warning and the data fingerprint."""
import json
import logging
from pathlib import Path

import pytest

import run_worker
from tests.helpers import run_main
from worker.choices import DATASET_FORMATS
from worker.data import IGNORE_INDEX, encode_example, encode_examples, split_examples
from worker.datasets import FORMATS, DatasetError, Example, Turn, load_examples
from worker.datasets.overlap import near_duplicates
from models.presets import PRESETS, build_tokenizer
from worker.splits import DataSettings, data_fingerprint, training_data

FORMATS_DIR = Path(__file__).resolve().parents[2] / "data" / "formats"
SAMPLES = {"prompt_completion.csv": "prompt-completion", "messages.jsonl": "messages", "alpaca.json": "alpaca",
           "sharegpt.json": "sharegpt", "text.jsonl": "text"}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(PRESETS["tiny-qwen2"])


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_the_flag_choices_are_the_registry():
    assert DATASET_FORMATS == ("auto", *FORMATS)


@pytest.mark.parametrize("name, fmt", SAMPLES.items())
def test_each_sample_is_detected_as_its_format_and_reads_the_same_forced(name, fmt):
    detected = load_examples(FORMATS_DIR / name)
    assert len(detected) == 24
    assert load_examples(FORMATS_DIR / name, fmt) == detected
    assert all(ex.plain_text == (fmt == "text") for ex in detected)


def test_what_each_reader_makes_of_a_row(tmp_path):
    first = {name: load_examples(FORMATS_DIR / name)[0] for name in SAMPLES}
    rows = {name: (json.loads((FORMATS_DIR / name).read_text()) if name.endswith(".json")
                   else [json.loads(line) for line in (FORMATS_DIR / name).read_text().splitlines()])
            for name in SAMPLES if not name.endswith(".csv")}
    alpaca = rows["alpaca.json"][0]
    assert first["alpaca.json"] == Example(alpaca["instruction"] + "\n\n" + alpaca["input"], alpaca["output"])
    chat = rows["messages.jsonl"][0]["messages"]
    assert first["messages.jsonl"] == Example(chat[3]["content"], chat[4]["content"], context=(
        Turn("system", chat[0]["content"]), Turn("user", chat[1]["content"]), Turn("assistant", chat[2]["content"])))
    weighted = load_examples(FORMATS_DIR / "messages.jsonl")[5]
    assert [t.trained for t in weighted.context if t.role == "assistant"] == [False]  # "weight": 0
    share = rows["sharegpt.json"][0]["conversations"]
    assert first["sharegpt.json"].context == (Turn("user", share[0]["value"]), Turn("assistant", share[1]["value"]))
    assert first["text.jsonl"] == Example("", rows["text.jsonl"][0]["text"], plain_text=True)
    assert first["prompt_completion.csv"].reference_code.startswith("def ")


def test_optional_alpaca_fields_and_chat_completions(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Add.", "input": "", "output": "x + y", "system": "Be terse.",
                                               "history": [["hi", "hello"]]}])
    assert load_examples(path) == [Example("Add.", "x + y", context=(Turn("system", "Be terse."), Turn("user", "hi"),
                                                                      Turn("assistant", "hello")))]
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": [{"role": "user", "content": "q"}],
                                                "completion": [{"role": "assistant", "content": "a"}]}])
    assert load_examples(path) == [Example("q", "a")]


def test_containers_parquet_and_save_to_disk_read_like_the_json_file(tmp_path):
    import datasets

    rows = json.loads((FORMATS_DIR / "sharegpt.json").read_text())
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "chats.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table, "test": table.select(range(2))}).save_to_disk(str(tmp_path / "splits"))
    expected = load_examples(FORMATS_DIR / "sharegpt.json")
    assert load_examples(tmp_path / "chats.parquet") == expected
    assert load_examples(tmp_path / "saved") == expected
    assert load_examples(tmp_path / "splits") == expected  # the train split of a DatasetDict
    # Arrow gives every message every key: a message without "weight" comes back with None (was: an error)
    chats = [json.loads(line) for line in (FORMATS_DIR / "messages.jsonl").read_text().splitlines()]
    datasets.Dataset.from_list(chats).to_parquet(str(tmp_path / "messages.parquet"))
    assert load_examples(tmp_path / "messages.parquet") == load_examples(FORMATS_DIR / "messages.jsonl")


def test_a_file_in_no_known_format_names_the_keys_it_found_and_the_formats(tmp_path):
    path = tmp_path / "qa.csv"
    path.write_text("question,answer\nwhat?,that\n")
    with pytest.raises(DatasetError) as info:
        load_examples(path)
    message = str(info.value)
    assert message.startswith(f"{path}: no known dataset format fits its first rows (keys found: answer, question); "
                              "accepted: messages (messages); sharegpt (conversations); alpaca (instruction + output)")
    assert message.endswith("or force one with --dataset-format") and "\n" not in message


def test_the_worker_says_it_in_one_line_before_loading_a_model(tmp_path):
    path = tmp_path / "qa.csv"
    path.write_text("question,answer\nwhat?,that\n")
    code, _, err = run_main(run_worker.main, "--specialty", "qa_expert", "--dataset", str(path), "--base-model",
                            "no/such-model", "--coordinator-url", "http://127.0.0.1:9")
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {path}: no known dataset format")


@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "user", "content": "q"}]}, "no assistant turn to learn from"),
    ({"messages": [{"role": "tool", "content": "q"}]}, "\"messages\" message 1 has role 'tool'"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
     "no assistant turn to learn from"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]},
     "\"conversations\" turn 2 is from 'bot'"),
    ({"instruction": "do", "output": 3}, '"output" must be a string, got int'),
])
def test_a_bad_row_names_its_line_and_the_format(tmp_path, row, message):
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(DatasetError, match="^" + str(path) + " line 1: ") as info:
        load_examples(path)
    assert message in str(info.value)


# --- tokenisation ------------------------------------------------------------------------------

def expected_by_template(tokenizer, messages):
    """Ids and labels computed from the template's whole rendering: a token is learnt iff it lies inside a
    trained assistant turn's content or its <|im_end|>; the sequence ends after the last such turn."""
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, pos = [], 0
    for message in messages:
        header = f"<|im_start|>{message['role']}\n"
        start = full.index(header, pos) + len(header)
        pos = start + len(message["content"])
        if message["role"] == "assistant" and message.get("weight", 1):
            spans.append((start, pos + len("<|im_end|>")))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, labels = [], []
    for token, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"]):
        if a >= spans[-1][1]:
            break
        ids.append(token)
        labels.append(token if any(s <= a and b <= e for s, e in spans) else IGNORE_INDEX)
    return ids, labels


@pytest.mark.parametrize("row", [0, 5])  # row 5's first answer has "weight": 0
def test_multi_turn_labels_match_the_template_token_by_token(tokenizer, row):
    messages = json.loads((FORMATS_DIR / "messages.jsonl").read_text().splitlines()[row])["messages"]
    ids, labels = encode_example(tokenizer, load_examples(FORMATS_DIR / "messages.jsonl")[row], 4096)
    assert (ids, labels) == expected_by_template(tokenizer, messages)
    learnt = tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
    answers = [m["content"] for m in messages if m["role"] == "assistant" and m.get("weight", 1)]
    assert learnt == "".join(a + "<|im_end|>" for a in answers)
    assert len(answers) == (1 if row == 5 else 2)


def test_without_a_chat_template_turns_are_plain_text_and_it_is_said_once(tokenizer, caplog):
    plain = build_tokenizer(PRESETS["tiny-qwen2"])
    plain.chat_template = None
    example = Example("q2", "a2", context=(Turn("user", "q1"), Turn("assistant", "a1")))
    with caplog.at_level(logging.WARNING, logger="worker.data"):
        ids, labels = encode_example(plain, example, 256)
        encode_example(plain, example, 256)
    assert plain.decode(ids) == "q1\na1<|im_end|>q2\na2<|im_end|>"
    assert plain.decode([t for t in labels if t != IGNORE_INDEX]) == "a1<|im_end|>a2<|im_end|>"
    assert sum("has no chat template" in r.getMessage() for r in caplog.records) <= 1


def test_plain_text_is_packed_into_windows_learnt_on_every_token(tokenizer):
    docs = [Example("", "word " * 50, plain_text=True), Example("", "another short document", plain_text=True)]
    encoded = encode_examples(tokenizer, docs, 32)
    stream = [t for d in docs for t in tokenizer(d.reference_code)["input_ids"] + [tokenizer.eos_token_id]]
    assert [ids for ids, _ in encoded] == [stream[i:i + 32] for i in range(0, len(stream), 32)]
    assert all(ids == labels for ids, labels in encoded)
    assert encode_example(tokenizer, docs[0], 8) == (stream[:8], stream[:8])  # one document, for per-example scores


# --- split, near-duplicates, fingerprint -------------------------------------------------------

def grouped_rows(groups=40, variants=3):
    return [{"prompt": f"Problem {g}: how do I compute the running mean of column {g} in a frame "
                       f"when values are missing? (variant {v})", "reference_code": f"r = {g}", "origin": g}
            for g in range(groups) for v in range(variants)]


def test_split_key_keeps_every_group_on_one_side(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", grouped_rows())
    train, heldout = split_examples(load_examples(path, split_key="origin"), 0.2)
    assert heldout and train
    assert not {e.group for e in train} & {e.group for e in heldout}
    assert all(sum(e.group == g for e in heldout) == 3 for g in {e.group for e in heldout})


def test_split_key_missing_or_with_one_value_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "reference_code": "a"}])
    with pytest.raises(DatasetError, match=r'line 1: no "origin" \(--split-key\)'):
        load_examples(path, split_key="origin")
    path = write_jsonl(tmp_path / "one.jsonl", [{"prompt": f"p{i}", "reference_code": "a", "k": 1} for i in range(3)])
    with pytest.raises(DatasetError, match="all 3 rows share the value '1'"):
        split_examples(load_examples(path, split_key="k"))


def test_near_duplicates_straddling_the_split_are_warned_about_and_grouping_silences_it(tmp_path, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", grouped_rows())
    with caplog.at_level(logging.WARNING, logger="worker.splits"):
        training_data(path, DataSettings())
    warned = [r.getMessage() for r in caplog.records if "near-duplicate" in r.getMessage()]
    assert len(warned) == 1 and "--split-key FIELD" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="worker.splits"):
        training_data(path, DataSettings(split_key="origin"))
    assert not [r for r in caplog.records if "near-duplicate" in r.getMessage()]


def test_near_duplicates_finds_a_variant_and_not_a_stranger():
    base = "Given a dataframe with columns a and b, how do I keep the rows where a is larger than the mean of b"
    train = [Example(base, "x"), Example("Write a SQL query listing every department with its budget", "y")]
    found = near_duplicates(train, [Example(base.replace("larger", "smaller"), "z"),
                                    Example("Explain the difference between a list and a tuple in Python", "w")])
    assert [(f.heldout, f.train) for f in found] == [(0, 0)] and 0.5 <= found[0].similarity < 1


def test_eval_dataset_replaces_the_split(tmp_path):
    train_path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"task {i}", "reference_code": "a"} for i in range(30)])
    train, heldout = training_data(train_path, DataSettings(eval_dataset=FORMATS_DIR / "alpaca.json"))
    assert len(train) == 30 and heldout == load_examples(FORMATS_DIR / "alpaca.json")


def test_data_fingerprint_is_the_file_hash_by_default_and_covers_what_changes_training(tmp_path):
    import hashlib

    path = FORMATS_DIR / "text.jsonl"
    plain = hashlib.sha256(path.read_bytes()).hexdigest()
    assert data_fingerprint(path, DataSettings(), packed=False, max_seq_len=256) == plain  # old checkpoints resume
    others = {data_fingerprint(path, DataSettings(), packed=True, max_seq_len=256),
              data_fingerprint(path, DataSettings(), packed=True, max_seq_len=128),
              data_fingerprint(path, DataSettings(dataset_format="text"), packed=False, max_seq_len=256),
              data_fingerprint(path, DataSettings(split_key="id"), packed=False, max_seq_len=256)}
    assert len(others) == 4 and plain not in others
