"""gateway/sql_check.py: a SQL answer compiles on its schema or says why not (never executed, reads only)."""
import json
from pathlib import Path

import pytest

from gateway.sql_check import answer_sql, check_sql

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ('CREATE TABLE singer (Singer_ID, Name, Country, Age);\n'
          'CREATE TABLE concert (concert_ID, Singer_ID, "Home Town");')


@pytest.mark.parametrize("answer", [
    "SELECT count(*) FROM singer",
    "SELECT T1.Name FROM singer AS T1 JOIN concert AS T2 ON T1.Singer_ID = T2.Singer_ID WHERE T2.\"Home Town\" = 'x'",
    "```sql\nSELECT name FROM singer ORDER BY age DESC;\n```\nThis lists the singers.",
    # never run, only prepared: executed, this would loop for ever
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c",
])
def test_queries_that_read_existing_names_compile(answer):
    assert check_sql(SCHEMA, answer).compiles


@pytest.mark.parametrize("answer, reason", [
    ("SELECT count(*) FROM singers", "no such table"),
    ("SELECT Salary FROM singer", "no such column"),
    ("SELECT name FROM singer WHERE", "incomplete input"),
    ("The singers are counted with a query.", "syntax error"),
    ("", "no SQL"),
    ("DELETE FROM singer", "not authorized"),
    ("DROP TABLE singer", "not authorized"),
    ("SELECT 1 FROM singer SELECT 2", "syntax error"),
])
def test_a_wrong_or_writing_answer_does_not_compile_and_says_why(answer, reason):
    verdict = check_sql(SCHEMA, answer)
    assert not verdict.compiles and reason in verdict.reason


def test_only_the_first_statement_counts():
    assert answer_sql("SELECT 1; DROP TABLE singer") == "SELECT 1"
    assert answer_sql("```sql\nSELECT 2\n```") == "SELECT 2"


def test_every_shipped_held_out_reference_compiles_on_its_schema():
    """The check is only worth printing if Spider's own answers pass it."""
    path = ROOT / "data" / "spider" / "heldout" / "sql_expert.jsonl"
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    failing = [r["reference_code"] for r in records if not check_sql(r["schema_sql"], r["reference_code"]).compiles]
    assert len(records) == 106 and failing == []
