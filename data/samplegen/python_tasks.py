"""Python coding tasks: a signature and a one-line specification in, a checked function out."""
from __future__ import annotations

import hashlib

from .catalog_collections import collection_functions
from .catalog_numbers import numeric_functions
from .catalog_records import record_functions
from .catalog_text import text_functions
from .pyfunc import PyFunction, check

PHRASINGS = [
    "Write a Python function `{sig}` that: {summary}",
    "Implement `{sig}` in Python. {summary}",
    "Write a Python function `{sig}`. It should do the following: {summary}",
]


def all_functions() -> list[PyFunction]:
    """Every template function, each run against its oracle before it is used."""
    functions = numeric_functions() + collection_functions() + text_functions() + record_functions()
    names = [f.name for f in functions]
    if len(names) != len(set(names)):
        raise AssertionError("duplicate function names in the catalogues")
    for f in functions:
        check(f)
    return functions


def prompt_for(f: PyFunction) -> str:
    choice = int(hashlib.sha1(f.name.encode()).hexdigest(), 16) % len(PHRASINGS)
    return PHRASINGS[choice].format(sig=f.signature, summary=f.summary)
