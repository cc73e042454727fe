#!/usr/bin/env python3
"""Turn Spider's dev set into sql_expert's train/ and heldout/ files, split by whole databases.

Spider (Yu et al., EMNLP 2018) asks questions about 20 databases in its dev set; a question's
answer depends on its database's schema, and questions on one database repeat its table and
column names. So the split is by database (``db_id``), never by question: no held-out question
shares a database with a training one, and held out measures text-to-SQL on unseen schemas.

1. order the databases by sha1 of their db_id;
2. hold out databases in that order, skipping one that would put more than MAX_HELDOUT of the
   questions on the held-out side, until at least MIN_HELDOUT are held out;
3. carve the validation databases (what benchmarks tune on) from the training ones by the same
   rule, and write their db_ids to validation.json.

Each record is in the worker's input format: ``prompt`` is the schema, one line per table
(``table(col, col, ...)``, ``*`` after a primary key column, ``-> table.col`` after a foreign
key), then the question, as one user turn; ``reference_code`` is Spider's SQL query with runs of
whitespace outside string literals collapsed to one space (Spider's queries often have two spaces
in a row); ``db_id`` is kept. Held-out records also keep ``schema_sql``: CREATE TABLE statements
for the database, which the demo compiles generated answers against (gateway/sql_check.py).

The rule is deterministic (no random state, no Python hash()):

  python data/spider/split.py SOURCE_DIR          # SOURCE_DIR holds Spider's dev.json and tables.json
  python data/spider/split.py SOURCE_DIR --check  # exit 1 if the committed files differ
  python data/spider/split.py --check             # without Spider's files: exit 1 unless the committed
                                                  # files are split by the rule (databases, order, validation)

SOURCE_DIR is ``evaluation_examples/examples`` of a clone of https://github.com/taoyds/spider
(the files here came from commit b7b5b8c890cd30e35427348bb9eb8c6d1350ca7c).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EXPERT = "sql_expert"
MIN_HELDOUT = 0.10
"""Share of the questions held out at least (whole databases)."""
MAX_HELDOUT = 0.15
"""A database that would take the held-out share past this is skipped (kept for training)."""
FIELDS = ("prompt", "reference_code", "db_id")
CHECK_FIELD = "schema_sql"
"""Held-out records also carry their database's CREATE TABLE statements, for the SQL answer check."""
SOURCE_FILES = ("dev.json", "tables.json")

_LITERAL_OR_SPACE = re.compile(r"('(?:[^']|'')*'|\"(?:[^\"]|\"\")*\")|\s+")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def collapse_spaces(sql: str) -> str:
    """``sql`` with each run of whitespace outside string literals made one space, trimmed."""
    return _LITERAL_OR_SPACE.sub(lambda m: m.group(1) or " ", sql).strip()


def quoted(name: str) -> str:
    """A table or column name as SQL reads it: bare when it is a plain identifier, else in double quotes."""
    return name if _IDENTIFIER.fullmatch(name) else '"' + name.replace('"', '""') + '"'


def user_tables(table: Mapping[str, Any]) -> list[tuple[int, str]]:
    """(index, name) of a database's tables without SQLite's own (``sqlite_sequence``, listed by some databases):
    no question asks about them, and SQLite refuses to create them."""
    return [(t, name) for t, name in enumerate(table["table_names_original"]) if not name.lower().startswith("sqlite_")]


def schema_lines(table: Mapping[str, Any]) -> list[str]:
    """One ``table(col*, col -> other.col, ...)`` line per table of a tables.json entry."""
    names = table["table_names_original"]
    columns = table["column_names_original"]
    primary = set(table["primary_keys"])
    references = {src: dst for src, dst in table["foreign_keys"]}
    lines = []
    for t, name in user_tables(table):
        cells = []
        for c, (owner, column) in enumerate(columns):
            if owner != t:
                continue
            cell = quoted(column) + ("*" if c in primary else "")
            if c in references:
                dst_owner, dst_column = columns[references[c]]
                same = dst_column.lower() == column.lower()  # mostly: a key keeps its name (~10 tokens saved)
                cell += f" -> {quoted(names[dst_owner])}" + ("" if same else f".{quoted(dst_column)}")
            cells.append(cell)
        lines.append(f"{quoted(name)}({', '.join(cells)})")
    return lines


def schema_sql(table: Mapping[str, Any]) -> str:
    """CREATE TABLE statements with the database's tables and columns (untyped: SQLite needs no types)."""
    columns = table["column_names_original"]
    return "\n".join(f"CREATE TABLE {quoted(name)} ({', '.join(quoted(c) for owner, c in columns if owner == t)});"
                     for t, name in user_tables(table))


def prompt(table: Mapping[str, Any], question: str) -> str:
    """The user turn: the schema first, the question last (a prompt cut to fit keeps its tail)."""
    return f"SQLite database {table['db_id']}:\n" + "\n".join(schema_lines(table)) + f"\nQuestion: {question.strip()}"


def records(questions: Iterable[Mapping[str, Any]], tables: Mapping[str, Mapping[str, Any]]) -> list[dict[str, str]]:
    """Spider's questions as worker records (with ``schema_sql``; to_jsonl keeps it only where wanted)."""
    return [{"prompt": prompt(tables[q["db_id"]], q["question"]), "reference_code": collapse_spaces(q["query"]),
             "db_id": q["db_id"], CHECK_FIELD: schema_sql(tables[q["db_id"]])} for q in questions]


def heldout_databases(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The db_ids the rule holds out of ``rows`` (in the order it picked them)."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["db_id"]] = counts.get(r["db_id"], 0) + 1
    picked: list[str] = []
    held = 0
    for db in sorted(counts, key=lambda d: hashlib.sha1(d.encode()).hexdigest()):
        if held >= MIN_HELDOUT * len(rows):
            break
        if held + counts[db] <= MAX_HELDOUT * len(rows):
            picked.append(db)
            held += counts[db]
    return picked


def interleaved(rows: Sequence[dict[str, str]], databases: Sequence[str]) -> list[dict[str, str]]:
    """Round robin over ``databases`` (each in Spider's order), so the first few rows span every database
    (the demo scores the first 8 held-out questions)."""
    queues = [[r for r in rows if r["db_id"] == db] for db in databases]
    out = []
    for i in range(max(map(len, queues), default=0)):
        out += [q[i] for q in queues if i < len(q)]
    return out


def split(rows: Sequence[dict[str, str]]) -> tuple[list[dict[str, str]], list[dict[str, str]], list[str]]:
    """(train in Spider's order, heldout interleaved by database, validation db_ids carved from train)."""
    held = heldout_databases(rows)
    train = [r for r in rows if r["db_id"] not in held]
    return train, interleaved(rows, held), heldout_databases(train)


def to_jsonl(rows: Sequence[Mapping[str, str]], fields: Sequence[str]) -> str:
    return "".join(json.dumps({k: r[k] for k in fields}, ensure_ascii=False) + "\n" for r in rows)


def outputs(source: Path, out: Path) -> dict[Path, str]:
    """Every file the rule writes under ``out``, with its text."""
    questions = json.loads((source / "dev.json").read_text(encoding="utf-8"))
    tables = {t["db_id"]: t for t in json.loads((source / "tables.json").read_text(encoding="utf-8"))}
    return split_files(split(records(questions, tables)), out)


def split_files(parts: tuple[list[dict[str, str]], list[dict[str, str]], list[str]], out: Path) -> dict[Path, str]:
    train, heldout, validation = parts
    return {out / "train" / f"{EXPERT}.jsonl": to_jsonl(train, FIELDS),
            out / "heldout" / f"{EXPERT}.jsonl": to_jsonl(heldout, (*FIELDS, CHECK_FIELD)),
            out / "validation.json": json.dumps({EXPERT: validation}) + "\n"}


def resplit_shipped(out: Path) -> dict[Path, str]:
    """The rule applied again to the records of the files under ``out`` (Spider's order is train's order with
    each held-out database's questions in their file order): what those files must hold."""
    shipped = [json.loads(line) for side in ("train", "heldout")
               for line in (out / side / f"{EXPERT}.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    held = set(heldout_databases(shipped))
    train = [r for r in shipped if r["db_id"] not in held]
    heldout = [r for r in shipped if r["db_id"] in held]
    databases = sorted(held, key=lambda d: hashlib.sha1(d.encode()).hexdigest())
    return split_files((train, interleaved(heldout, databases), heldout_databases(train)), out)


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def expected_files(source: Path | None, out: Path) -> dict[Path, str] | str:
    """What the files under ``out`` must hold (from Spider's files in ``source``, or from the shipped files
    themselves when ``source`` is None), or a one-line error."""
    where = source if source is not None else out
    names = SOURCE_FILES if source is not None else (f"train/{EXPERT}.jsonl", f"heldout/{EXPERT}.jsonl")
    missing = [name for name in names if not (where / name).is_file()]
    if missing:
        return f"{', '.join(str(where / m) for m in missing)} missing" + (
            "; pass Spider's evaluation_examples/examples directory" if source is not None else "")
    try:
        return outputs(source, out) if source is not None else resplit_shipped(out)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        return f"{where} does not hold the files as expected: {type(exc).__name__}: {exc}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, nargs="?", help="directory with Spider's dev.json and tables.json")
    p.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    p.add_argument("--out", type=Path, default=HERE, help="where the files are (default: %(default)s)")
    args = p.parse_args()
    if args.source is None and not args.check:
        p.error("SOURCE_DIR is required to write the files (only --check works without it)")
    files = expected_files(args.source, args.out)
    if isinstance(files, str):
        print(f"error: {files}", file=sys.stderr)
        return 2
    differ = [path for path, text in files.items()
              if not path.is_file() or path.read_text(encoding="utf-8") != text] if args.check else []
    for path, text in files.items():
        if not args.check:
            write_atomically(path, text)
        rows = text.count("\n") if path.suffix == ".jsonl" else None
        print(f"{path.relative_to(args.out)}: {f'{rows} questions' if rows is not None else text.strip()}")
    if differ:
        print(f"differs from the rule: {', '.join(map(str, differ))}", file=sys.stderr)
        return 1
    print("committed files match the rule" if args.check else "written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
