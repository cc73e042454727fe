"""Write FedMoE's sample datasets: data/python_expert.jsonl, sql_expert.jsonl, docs_expert.jsonl, and
one small sample per dataset format the worker reads in data/formats/ (samplegen/formats.py).

Everything is generated from templates in data/samplegen/ (nothing is copied from elsewhere) and
checked before it is written: Python answers are executed against independent oracles, SQL
answers are run on an in-memory sqlite3 database and must return rows. The output is
byte-for-byte deterministic; tests/worker/test_sample_data.py regenerates it and compares.

    python data/make_samples.py            # rewrite the files next to this script
    python data/make_samples.py --out DIR  # write them somewhere else
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from samplegen import docs_tasks, formats, python_tasks, sql_tasks  # noqa: E402

MAX_FILE_BYTES = 400 * 1024


def python_records() -> list[dict]:
    return [{"id": f"python/{f.family}/{f.name}", "prompt": python_tasks.prompt_for(f), "reference_code": f.code}
            for f in python_tasks.all_functions()]


def sql_records() -> list[dict]:
    return [{"id": f"sql/{t.template}/{i}", "prompt": sql_tasks.prompt_for(t), "reference_code": t.sql + "\n"}
            for i, t in enumerate(sql_tasks.sql_tasks())]


def docs_records() -> list[dict]:
    functions = python_tasks.all_functions()
    tasks = docs_tasks.docstring_tasks(functions) + docs_tasks.readme_tasks() + docs_tasks.changelog_tasks()
    return [{"id": t.id, "prompt": t.prompt, "reference_code": t.answer} for t in tasks]


DATASETS = {"python_expert": python_records, "sql_expert": sql_records, "docs_expert": docs_records}


def render(records: list[dict]) -> bytes:
    lines = (json.dumps(r, ensure_ascii=False, sort_keys=True) for r in records)
    return "".join(line + "\n" for line in lines).encode("utf-8")


def write_all(out_dir: Path) -> dict[str, int]:
    """Write every dataset into out_dir; returns the number of examples per file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, make in DATASETS.items():
        records = make()
        data = render(records)
        if len(data) > MAX_FILE_BYTES:
            raise AssertionError(f"{name}: {len(data)} bytes, over the {MAX_FILE_BYTES} byte budget")
        (out_dir / f"{name}.jsonl").write_bytes(data)
        counts[name] = len(records)
    (out_dir / "formats").mkdir(exist_ok=True)
    for file_name, make_bytes in formats.FILES.items():
        (out_dir / "formats" / file_name).write_bytes(make_bytes())
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                        help="directory to write the .jsonl files into (default: this script's directory)")
    args = parser.parse_args(argv)
    for name, count in write_all(args.out).items():
        print(f"{args.out / (name + '.jsonl')}: {count} examples")
    print(f"{args.out / 'formats'}: {', '.join(formats.FILES)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
