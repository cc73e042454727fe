"""One small sample per dataset format the worker reads, made from this project's own sample tasks.

Each shows the layout people bring from elsewhere, in the container they usually bring it in:

    prompt_completion.csv  TRL prompt/completion pairs      (Python functions)
    messages.jsonl         OpenAI chat, two user turns each  (Python functions, system prompt, one weight 0)
    alpaca.json            Stanford Alpaca, a JSON array     (SQL: the question is the instruction, the tables the input)
    sharegpt.json          ShareGPT conversations            (a README, then its changelog entry)
    text.jsonl             plain documents                   (READMEs and changelogs, for continued pre-training)

FedMoE's own prompt/reference_code layout is the three domain files next to these.
"""
from __future__ import annotations

import csv
import io
import json
from typing import Any

from . import docs_tasks, python_tasks, sql_tasks

ROWS = 24
SYSTEM = "You are a careful Python programmer. Answer with code only."


def _python_pairs() -> list[tuple[str, str]]:
    return [(python_tasks.prompt_for(f), f.code) for f in python_tasks.all_functions()[::7]]


def prompt_completion_csv() -> bytes:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["prompt", "completion"])
    writer.writerows(_python_pairs()[:ROWS])
    return out.getvalue().encode("utf-8")


def messages_rows() -> list[dict[str, Any]]:
    pairs = _python_pairs()
    rows = []
    for i in range(ROWS):
        (ask1, code1), (ask2, code2) = pairs[(2 * i) % len(pairs)], pairs[(2 * i + 1) % len(pairs)]
        first: dict[str, Any] = {"role": "assistant", "content": code1}
        if i % 6 == 5:
            first["weight"] = 0  # OpenAI's way of keeping a turn out of the loss
        rows.append({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask1}, first,
                                  {"role": "user", "content": "Now this one. " + ask2},
                                  {"role": "assistant", "content": code2}]})
    return rows


def alpaca_rows() -> list[dict[str, Any]]:
    rows = []
    for task in sql_tasks.sql_tasks()[::9][:ROWS]:
        tables, question = sql_tasks.prompt_for(task).split("\n\n", 1)
        rows.append({"instruction": question, "input": tables, "output": task.sql + "\n"})
    return rows


def _readmes_and_changelogs() -> tuple[list[docs_tasks.DocTask], list[docs_tasks.DocTask]]:
    return docs_tasks.readme_tasks(), docs_tasks.changelog_tasks()


def sharegpt_rows() -> list[dict[str, Any]]:
    readmes, changelogs = _readmes_and_changelogs()
    rows = []
    for i in range(ROWS):
        readme, changelog = readmes[i % len(readmes)], changelogs[i % len(changelogs)]
        rows.append({"conversations": [{"from": "human", "value": readme.prompt}, {"from": "gpt", "value": readme.answer},
                                       {"from": "human", "value": changelog.prompt},
                                       {"from": "gpt", "value": changelog.answer}]})
    return rows


def text_rows() -> list[dict[str, Any]]:
    readmes, changelogs = _readmes_and_changelogs()
    return [{"text": task.answer} for pair in zip(readmes, changelogs) for task in pair][:ROWS]


def json_lines(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode("utf-8")


def json_array(rows: list[dict[str, Any]]) -> bytes:
    return (json.dumps(rows, ensure_ascii=False, sort_keys=True, indent=1) + "\n").encode("utf-8")


FILES = {
    "prompt_completion.csv": prompt_completion_csv,
    "messages.jsonl": lambda: json_lines(messages_rows()),
    "alpaca.json": lambda: json_array(alpaca_rows()),
    "sharegpt.json": lambda: json_array(sharegpt_rows()),
    "text.jsonl": lambda: json_lines(text_rows()),
}
"""File name under data/formats/ -> its bytes."""
