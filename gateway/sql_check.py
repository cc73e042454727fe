"""Does a generated SQL answer compile against its database's schema? A weak check, not correctness.

Spider's dev set ships its questions and schemas but not its SQLite files (they are a separate
download), so the execution accuracy Spider reports cannot be computed here. What can be checked
honestly: the answer is one SQL statement that SQLite prepares against empty tables with the
database's names (syntax right, every table and column it names exists), and it only reads. An
answer can pass and still be wrong (the wrong column, the wrong filter); an answer that fails is
certainly wrong. The demo prints this as "compiles on the schema", never as pass@1.

Nothing is executed: ``EXPLAIN`` prepares the statement and lists its bytecode without running it,
so a generated runaway query (say an unbounded recursive CTE) costs nothing, and an authorizer
refuses anything but reads while the statement is prepared.
"""
from __future__ import annotations

import sqlite3
from dataclasses import dataclass

_READS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}


@dataclass(frozen=True)
class SqlVerdict:
    compiles: bool
    reason: str
    """Why it does not compile (SQLite's message), or "" when it does."""


def answer_sql(text: str) -> str:
    """The SQL of a generated answer: inside a Markdown fence when there is one, up to the first ``;``."""
    if "```" in text:
        parts = text.split("```")
        text = parts[1] if len(parts) > 2 else parts[-1]
        if text.lower().startswith("sql\n"):
            text = text[4:]
    return text.split(";", 1)[0].strip()


def _reads_only(action: int, *_: object) -> int:
    return sqlite3.SQLITE_OK if action in _READS else sqlite3.SQLITE_DENY


def check_sql(schema_sql: str, answer: str) -> SqlVerdict:
    """Whether ``answer`` (a generated answer, see answer_sql) compiles as a read-only query on ``schema_sql``."""
    sql = answer_sql(answer)
    if not sql:
        return SqlVerdict(False, "no SQL in the answer")
    with sqlite3.connect(":memory:") as conn:
        conn.executescript(schema_sql)
        conn.set_authorizer(_reads_only)
        try:
            conn.execute("EXPLAIN " + sql).fetchall()
        except (sqlite3.Error, sqlite3.Warning, ValueError) as exc:  # Warning: several statements at once
            return SqlVerdict(False, str(exc))
    return SqlVerdict(True, "")
