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
and the code disagree). After `pip install .` each script is also a command that runs the same
`main()` (`fedmoe-worker --help` prints what `python run_worker.py --help` prints). Every script also
has `--version`; a mistake you can fix ends with one line `error: <what>; <how to fix it>` and exit
code 2.

## Adding a flag: one dataclass field

Each flag is a field of a config dataclass that carries its default and its help (as PEFT's
`LoraConfig` does); `protocol.cli.add_flags` builds argparse from the fields, so the flag, its
default, its `--help` line and this page come from one place:

| script (installed command) | flags declared in |
|---|---|
| `run_coordinator.py` (`fedmoe-coordinator`) | `coordinator.config.CoordinatorConfig`, `coordinator.config.ServeOptions`, `run_coordinator.RelayFlags`, `run_coordinator.AdminFlags` |
| `run_worker.py` (`fedmoe-worker`) | `run_worker.WorkerFlags` (mapped onto `WorkerConfig` by `build_config`) |
| `get_gateway_model.py` (`fedmoe-gateway`) | `get_gateway_model.GatewayToolFlags` |
| `serve.py` (`fedmoe-serve`) | `serve.ServeFlags`, `serving.config.Limits`, `serving.config.EngineOptions` |

```python
from protocol.cli import option

forward_interval: float = option(30.0, "seconds between forwards to --upstream")   # --forward-interval
upstream: str | None = option(None, "coordinator to forward to", metavar="URL")   # type from the default,
sync_budget: int | None = option(None, "bytes per sync", type=int)                 #  or given when it is None
compression: str = option("safetensors", "update codec", choices=CODEC_NAMES, group="compression")
auth: bool = option(True, "accept requests without tokens", flag="--no-auth")      # True -> store_false flag
gateway_config: Mapping = option(help="...", default_factory=dict, parse=json_object)  # parsed, errors name the flag
```

`option(default, help, *, flag=None, parse=None, **add_argument_kwargs)`: the flag is
`--<field-name>` unless `flag` says otherwise; a `bool` defaulting to False is a `store_true`
switch and one defaulting to True a `store_false` one; ` (default: ...)` is appended to the help
unless the default is None or the help states it. `parse(text, flag)` turns the string into the
value (`protocol.cli.json_object`, `comma_list`) and raises `ValueError` naming the flag; the
dataclass default stands when the flag is absent. A field without help is not a flag. The
config's `__post_init__` keeps the one-line checks that quote the flag (`--port must be 0-65535,
got 70000`). The scripts import only these light modules before parsing, so `--help` never loads
torch; `tests/cli` checks that, and that `WorkerFlags` defaults equal the worker settings they fill.
After adding a flag, run `python scripts/cli_docs.py`.
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
