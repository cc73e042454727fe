"""A cheap check for near-duplicate prompts on both sides of a held-out split.

A random split of rows leaks when rows are variants of one another (DS-1000 rewrites most problems
several times): the held-out loss then measures recall of a near-copy, and the worker cannot see
that it overfits. This finds held-out examples whose prompt shares most of its word 5-grams with a
training prompt (Jaccard similarity of the shingle sets, as in Broder 1997, "On the resemblance
and containment of documents"), through an inverted index, so its cost grows with the rows, not
their pairs. Shingles that most prompts share (a task's boilerplate) are left out of the sets.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from worker.datasets.base import Example

SHINGLE_WORDS = 5
"""Words per shingle."""
PREFIX_WORDS = 300
"""Words of each prompt compared: a problem's statement; long code tails add cost, not evidence."""
SIMILAR = 0.5
"""Jaccard similarity of two prompts' shingle sets at or above which they count as near-duplicates."""
COMMON = 0.05
"""A shingle in more than this share of training prompts (and more than 10) is boilerplate, not evidence."""
WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class NearDuplicate:
    heldout: int
    """Index of the held-out example."""
    train: int
    """Index of its most similar training example."""
    similarity: float
    """Jaccard similarity of their informative shingle sets."""


def shingles(text: str) -> set[int]:
    """Hashes of the normalised text's word 5-grams (lower case, words only; one shingle if shorter)."""
    words = WORD.findall(text.lower())[:PREFIX_WORDS]
    if len(words) <= SHINGLE_WORDS:
        return {hash(tuple(words))} if words else set()
    return {hash(tuple(words[i:i + SHINGLE_WORDS])) for i in range(len(words) - SHINGLE_WORDS + 1)}


def compared_text(example: Example) -> str:
    return example.reference_code if example.plain_text else example.prompt


def near_duplicates(train: Sequence[Example], heldout: Sequence[Example],
                    threshold: float = SIMILAR) -> list[NearDuplicate]:
    """Every held-out example with a training example at least `threshold` similar, and its closest one."""
    train_sets = [shingles(compared_text(ex)) for ex in train]
    index: dict[int, list[int]] = {}
    for row, shingle_set in enumerate(train_sets):
        for shingle in shingle_set:
            index.setdefault(shingle, []).append(row)
    common = max(10, int(COMMON * len(train)))
    boilerplate = {shingle for shingle, rows in index.items() if len(rows) > common}
    sizes = [len(s - boilerplate) for s in train_sets]
    found = []
    for row, example in enumerate(heldout):
        own = shingles(compared_text(example)) - boilerplate
        shared = Counter(other for shingle in own for other in index.get(shingle, ()))
        best = max(((count / (len(own) + sizes[other] - count), other) for other, count in shared.items()),
                   default=(0.0, -1))
        if best[0] >= threshold:
            found.append(NearDuplicate(row, best[1], round(best[0], 3)))
    return found
