#!/usr/bin/env python3
"""Write docs/cli.md from the scripts' own ``--help``, so the flag reference cannot drift from the code.

    python scripts/cli_docs.py            # rewrite docs/cli.md
    python scripts/cli_docs.py --check    # exit 1 if docs/cli.md is out of date (tests/cli/test_cli_docs.py)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cli.md"
SCRIPTS = ("run_coordinator.py", "run_worker.py", "get_gateway_model.py", "serve.py")
HEADER = """# Command lines

Generated from each script's `--help` by `python scripts/cli_docs.py` (a test fails when this page
and the code disagree). Every script also has `--version`; a mistake you can fix ends with one line
`error: <what>; <how to fix it>` and exit code 2.
"""


def help_text(script: str) -> str:
    # A fixed width (argparse wraps to $COLUMNS) and a fixed config dir (defaults shown in the help, e.g.
    # serve.py's key file, live there): the page must not depend on the terminal or the user.
    env = {k: v for k, v in os.environ.items() if k != "XDG_CONFIG_HOME"}
    env |= {"COLUMNS": "100", "HF_HUB_OFFLINE": "1", "FEDMOE_CONFIG_DIR": "~/.config/fedmoe"}
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout.rstrip()


def render() -> str:
    sections = [f"## `{script}`\n\n```text\n{help_text(script)}\n```\n" for script in SCRIPTS]
    return HEADER + "\n" + "\n".join(sections)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when they differ")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = DOC.read_text() if DOC.exists() else ""
        if current != text:
            print(f"{DOC.relative_to(ROOT)} is out of date: run python scripts/cli_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
