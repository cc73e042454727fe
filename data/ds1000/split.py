#!/usr/bin/env python3
"""Split three DS-1000 domains into train/ and heldout/ files so no held-out problem leaks into training.

DS-1000 rewrites most problems several times (surface and semantic perturbations of one origin),
and those variants sit next to each other in problem_id order. A split per problem would put
two thirds of the held-out problems next to a near-copy in training (measured: a prompt similarity
above 0.8 for 18 of 27 numpy, 22 of 29 pandas and 3 of 6 sklearn problems under a 10% hash split),
so this splits whole families instead:

1. sort a domain by problem_id; a problem joins the current family when its prompt is similar
   (difflib ratio > FAMILY_SIMILARITY on the first 800 characters) to the family's first or last
   problem, else it starts a new family;
2. order the families by sha1 of their first problem_id and hold out whole families, in that
   order, until HELDOUT_FRACTION of the domain is held out;
3. move any training problem whose prompt is still near a held-out one (ratio > NEAR_COPY) to
   the held-out side too (a variant that is not adjacent to its origin).

The rule is deterministic (no random state, no Python hash()), so the committed files can be
regenerated and checked:

  python data/ds1000/split.py SOURCE_DIR          # SOURCE_DIR holds numpy.jsonl, pandas.jsonl, sklearn.jsonl
  python data/ds1000/split.py SOURCE_DIR --check  # exit 1 if the committed files differ

The benchmarks tune their settings on a *validation* split carved from train/ by the same rule.
Its problem ids are committed too (validation.json), since the pairwise difflib comparisons cost
~15 CPU seconds, which every benchmark process used to pay again:

  python data/ds1000/split.py --validation          # rewrite validation.json from train/
  python data/ds1000/split.py --validation --check  # exit 1 if it differs from the rule

Records keep the fields of FIELDS with their text unchanged, one JSON object per line; held-out records
also keep DS-1000's test harness (``code_context``), which pass@1 executes generated answers with.
"""
from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOMAINS = {"numpy_expert": "numpy.jsonl", "pandas_expert": "pandas.jsonl", "sklearn_expert": "sklearn.jsonl"}
FAMILY_SIMILARITY = 0.5
"""Prompts of adjacent problems above this ratio are variants of one problem."""
NEAR_COPY = 0.6
"""A training prompt this close to a held-out prompt moves to the held-out side."""
HELDOUT_FRACTION = 0.1
"""Share of each domain's problems held out (whole families, so slightly more)."""
FIELDS = ("prompt", "reference_code", "library", "problem_id")
HARNESS = "code_context"
"""DS-1000's test harness of a problem (generate_test_case, exec_test, test_execution): kept on held-out records."""
PREFIX = 800
"""Characters of each prompt compared (the problem statement; the long code tails add little)."""


def similarity(a: dict, b: dict) -> float:
    return difflib.SequenceMatcher(None, a["prompt"][:PREFIX], b["prompt"][:PREFIX]).ratio()


def families(records: list[dict]) -> list[list[dict]]:
    """Runs of adjacent problems (in problem_id order) that are variants of one another."""
    groups: list[list[dict]] = []
    for record in sorted(records, key=lambda r: r["problem_id"]):
        if groups and max(similarity(groups[-1][0], record), similarity(groups[-1][-1], record)) > FAMILY_SIMILARITY:
            groups[-1].append(record)
        else:
            groups.append([record])
    return groups


def split_domain(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(train, heldout), each in problem_id order."""
    order = sorted(families(records), key=lambda g: hashlib.sha1(str(g[0]["problem_id"]).encode()).hexdigest())
    heldout: list[dict] = []
    for family in order:
        if len(heldout) >= HELDOUT_FRACTION * len(records):
            break
        heldout += family
    held = {r["problem_id"] for r in heldout}
    train = [r for r in records if r["problem_id"] not in held]
    near = [r for r in train if any(similarity(r, h) > NEAR_COPY for h in heldout)]
    held |= {r["problem_id"] for r in near}
    by_id = sorted(records, key=lambda r: r["problem_id"])
    return [r for r in by_id if r["problem_id"] not in held], [r for r in by_id if r["problem_id"] in held]


VALIDATION = HERE / "validation.json"


def validation_ids() -> dict[str, list[int]]:
    """Per expert, the problem ids of train/ that the rule holds out again as the validation split."""
    ids = {}
    for expert in DOMAINS:
        train = [json.loads(line) for line in (HERE / "train" / f"{expert}.jsonl").read_text(encoding="utf-8").splitlines()
                 if line.strip()]
        ids[expert] = [r["problem_id"] for r in split_domain(train)[1]]
    return ids


def validation_json(ids: dict[str, list[int]]) -> str:
    return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in ids.items()) + "\n}\n"


def write_validation(check: bool) -> int:
    text = validation_json(validation_ids())
    if check:
        if not VALIDATION.is_file() or VALIDATION.read_text(encoding="utf-8") != text:
            print(f"differs from the rule: {VALIDATION}", file=sys.stderr)
            return 1
    else:
        tmp = VALIDATION.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(VALIDATION)
    print(f"validation ids of {', '.join(DOMAINS)}: {'match' if check else 'written to'} {VALIDATION.name}")
    return 0


def to_jsonl(records: list[dict], fields: tuple[str, ...] = FIELDS) -> str:
    return "".join(json.dumps({k: r[k] for k in fields if k in r}, ensure_ascii=False) + "\n" for r in records)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, nargs="?",
                   help="directory with DS-1000's numpy.jsonl, pandas.jsonl, sklearn.jsonl")
    p.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    p.add_argument("--validation", action="store_true",
                   help="carve the validation ids from the committed train/ files (validation.json); no SOURCE_DIR")
    args = p.parse_args()
    if args.validation:
        return write_validation(args.check)
    if args.source is None:
        p.error("SOURCE_DIR is required (or --validation)")
    differ = []
    for expert, filename in DOMAINS.items():
        path = args.source / filename
        if not path.is_file():
            print(f"error: {path} is missing; pass the directory that holds {', '.join(DOMAINS.values())}",
                  file=sys.stderr)
            return 2
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        for side, part in zip(("train", "heldout"), split_domain(records)):
            target = HERE / side / f"{expert}.jsonl"
            text = to_jsonl(part, FIELDS + ((HARNESS,) if side == "heldout" else ()))
            if args.check:
                if not target.is_file() or target.read_text(encoding="utf-8") != text:
                    differ.append(str(target))
            else:
                target.parent.mkdir(exist_ok=True)
                target.write_text(text, encoding="utf-8")
            print(f"{side:>8} {expert:<15} {len(part):4d} problems")
    if differ:
        print(f"differs from the rule: {', '.join(differ)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
