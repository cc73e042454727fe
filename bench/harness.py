"""The benchmark harness: what every ``python -m bench.<name>`` shares, written once.

A benchmark module declares itself at its end::

    @dataclass(frozen=True)
    class Settings:
        size_mb: int = option(256, "model size in MiB")
        repeats: int = option(3, "timed steps per rule, best of")

    def run(s: Settings, ctx: Run) -> int:
        report = measure(s.size_mb, s.repeats)
        ctx.write(report)              # bench/results/aggregation.json (or --out), stamped
        print(render(report))
        return 0                       # the exit code: 1 when the bench found a fault

    BENCH = Bench("aggregation", tags=("performance",), settings=Settings, run=run,
                  quick={"size_mb": 16, "repeats": 1})
    main = BENCH.main

    if __name__ == "__main__":
        sys.exit(main())

The settings dataclass is the bench's own flags, one ``option()`` field each (protocol/cli.py, the
pattern the scripts use): a flag, its default and its help cannot drift apart. The harness adds the
three every bench has, ``--quick`` (the ``quick`` overrides; flags given still win), ``--out``
(default ``bench/results/<name>.json``) and ``-v``; it configures logging, seeds ``random``, numpy
and torch, gives torch its thread budget, turns a bad value (a ``ValueError`` from the settings'
``__post_init__``) into one ``error:`` line and exit 2, and stamps every result it writes with the
commit, whether the tree had uncommitted code changes, the machine load and the date.

``python -m bench.run_all`` finds the benchmarks by reading each module's ``BENCH = Bench(...)``
line (``declared_benches``), without importing them: tags select the groups, ``cores`` says how
many run side by side.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import functools
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from bench.common import RESULTS_DIR, ROOT, configure_logging, write_json_atomic
from protocol.cli import EXIT_USAGE, flag_fields, flag_name

S = TypeVar("S")
BENCH_DIR = Path(__file__).resolve().parent
QUICK_RESULTS_DIR = RESULTS_DIR / "quick"
"""Where --quick writes by default: not a figure, so not bench/results/ (git ignores it)."""
TAGS: dict[str, str] = {
    "performance": "speed of the serving path (`make bench`, under 10 minutes)",
    "quality": "learning quality on smollm2-135m (`make bench-quality`)",
    "robustness": "tiny-qwen2 sweeps, poisoning, scaling, crashes, hostile clients (`make bench-robustness`)",
    "learning": "convergence and tuning runs of the federated arms",
    "training": "a worker's training and sync costs",
    "durability": "kills, restarts and growth of what is kept on disk",
    "http": "the coordinator's HTTP front",
    "network": "emulated links (network namespaces or a delay proxy)",
    "scale": "replicas on PostgreSQL and an S3 store",
    "serving": "the OpenAI-compatible server",
    "merging": "the gateway's merges",
    "privacy": "secure aggregation and differential privacy: costs, learning, membership inference",
    "a-b": "this checkout against another one, in one run",
    "gpu": "a CUDA device (exits 0 without one)",
    "sweep": "a hyper-parameter sweep: its arms are given on the command line",
}
"""What a tag says of a bench; run_all selects benches by tag. The first three are make's groups."""
REGISTRY: dict[str, Bench[Any]] = {}
"""Every bench imported so far, by name."""


@dataclass(frozen=True)
class Run:
    """One run of a bench, as its ``run`` function sees it."""

    bench: str
    """The bench's name."""
    settings: Any
    """The settings the run uses (the bench's dataclass, after --quick and the flags)."""
    out: Path
    """Where its result goes (--out)."""
    quick: bool
    """--quick was given."""
    verbose: bool
    """-v was given."""
    started: float = field(default_factory=time.monotonic)
    load_at_start: tuple[float, float, float] = field(default_factory=os.getloadavg)

    def seconds(self) -> float:
        """Wall seconds since the run started."""
        return round(time.monotonic() - self.started, 1)

    def stamp(self) -> dict[str, Any]:
        """What every result carries: which code, on how loaded a machine, when, with which settings."""
        commit, dirty = source_state()
        return {"bench": self.bench, "commit": commit, "dirty": dirty,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "load_average": {"start": [round(x, 2) for x in self.load_at_start],
                                 "end": [round(x, 2) for x in os.getloadavg()]},
                "cpu_count": os.cpu_count(), "quick": self.quick, "seconds": self.seconds(),
                "settings": jsonable(dataclasses.asdict(self.settings))}

    def write(self, report: Mapping[str, Any], path: Path | None = None) -> Path:
        """Write ``report`` with its ``stamp`` to ``path`` (default --out) atomically; returns the path."""
        target = path or self.out
        write_json_atomic(target, {**report, "stamp": self.stamp()})
        return target


@dataclass(frozen=True)
class Bench(Generic[S]):
    """A benchmark as the suite knows it; constructing one registers it."""

    name: str
    """The module's name under bench/ and its result file's stem."""
    tags: tuple[str, ...]
    """Groups and needs, of ``TAGS``."""
    settings: type[S]
    """Frozen dataclass; its ``option()`` fields are the bench's flags."""
    run: Callable[[S, Run], int]
    """The bench itself: returns the exit code (1 when it found a fault it reports)."""
    quick: Mapping[str, Any] = field(default_factory=dict)
    """Settings --quick changes (a smoke run of seconds to a few minutes; tests/bench run it)."""
    cores: int = 2
    """Cores it keeps busy: run_all runs benches side by side up to the machine's 2 (timing benches take both)."""
    torch_threads: int | None = 1
    """torch.set_num_threads before the run (None: the bench does not use torch in this process)."""

    def __post_init__(self) -> None:
        unknown = set(self.tags) - set(TAGS)
        if unknown:
            raise ValueError(f"bench {self.name}: unknown tags {sorted(unknown)}; choose from {sorted(TAGS)}")
        names = {f.name for f in dataclasses.fields(self.settings)}  # type: ignore[arg-type]
        if set(self.quick) - names:
            raise ValueError(f"bench {self.name}: quick sets {sorted(set(self.quick) - names)}, not settings fields")
        REGISTRY[self.name] = self

    def parser(self) -> argparse.ArgumentParser:
        """The bench's command line: its settings' flags and the harness's three."""
        module = sys.modules.get(self.run.__module__)
        p = argparse.ArgumentParser(prog=f"python -m bench.{self.name}", description=module.__doc__ if module else None,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        add_settings_flags(p, self.settings, self.quick)
        p.add_argument("--quick", action="store_true",
                       help="a smoke run of a few minutes at most" + _quick_help(self.quick))
        p.add_argument("--out", type=Path, default=None,
                       help=f"results JSON (default: bench/results/{self.name}.json; with --quick "
                            f"bench/results/quick/{self.name}.json, which git ignores: a smoke run never replaces "
                            "the figures)")
        p.add_argument("-v", "--verbose", action="store_true", help="library logs too")
        return p

    def settings_from(self, args: argparse.Namespace) -> S:
        """The settings: the dataclass defaults, then --quick's overrides, then every flag given."""
        base = self.settings(**self.quick) if args.quick else self.settings()
        return dataclasses.replace(base, **given_settings(self.settings, args))  # type: ignore[type-var]

    def parse(self, argv: Sequence[str] | None = None) -> tuple[S, argparse.Namespace]:
        """(settings, the harness's flags); a bad value ends the program with one ``error:`` line and exit 2."""
        p = self.parser()
        args = p.parse_args(argv)
        try:
            return self.settings_from(args), args
        except (ValueError, TypeError) as exc:  # the settings' own checks: one line that names the flag
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(EXIT_USAGE) from None

    def main(self, argv: Sequence[str] | None = None) -> int:
        """Parse, set up (logging, seeds, threads), run; the exit code (2 for a bad flag, as argparse's own)."""
        try:
            settings, args = self.parse(argv)
        except SystemExit as exc:  # --help (0), argparse's usage errors and the settings' checks (2)
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
        configure_logging(args.verbose)
        seed_everything(getattr(settings, "seed", 0), self.torch_threads)
        out = args.out or (QUICK_RESULTS_DIR if args.quick else RESULTS_DIR) / f"{self.name}.json"
        return self.run(settings, Run(self.name, settings, out, args.quick, args.verbose))


def add_settings_flags(parser: argparse.ArgumentParser, cls: type, quick: Mapping[str, Any]) -> None:
    """One flag per ``option()`` field of ``cls``. Their argparse default is None, so that a flag given can be
    told from one left out: left out, the dataclass's (or --quick's) value stands."""
    defaults = cls()
    for f in flag_fields(cls):
        kwargs = dict(f.metadata["argparse"])
        default = getattr(defaults, f.name)
        help_text = argparse.SUPPRESS if kwargs.pop("hidden", False) else f.metadata["help"]
        if isinstance(default, bool):
            kwargs.setdefault("action", "store_false" if default else "store_true")
        elif f.metadata["parse"] is None and "type" not in kwargs and default is not None \
                and not isinstance(default, (list, tuple)):
            kwargs["type"] = type(default)
        if help_text != argparse.SUPPRESS and "(default" not in help_text and default not in (None, ()) \
                and not kwargs.get("required"):
            shown = _shown(default, "," if f.metadata["parse"] is not None else " ")
            help_text += f" (default: {shown}" + (f"; --quick: {_shown(quick[f.name])}" if f.name in quick else "") + ")"
        parser.add_argument(flag_name(f), dest=f.name, default=None, help=help_text, **kwargs)


def given_settings(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """{field: value} of the settings flags given on the command line (lists as tuples)."""
    values = {}
    for f in flag_fields(cls):
        value = getattr(args, f.name)
        if value is None:
            continue
        parse = f.metadata["parse"]
        if parse is not None:
            value = parse(value, flag_name(f))
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return values


def _shown(value: Any, separator: str = " ") -> str:
    return separator.join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _quick_help(quick: Mapping[str, Any]) -> str:
    return "" if not quick else " (" + ", ".join(f"{k}={_shown(v)}" for k, v in quick.items()) + ")"


def seed_everything(seed: int, torch_threads: int | None) -> None:
    """The same random draws on every run; torch's thread budget (one by default: the machine is shared, and
    torch's OpenMP threads spin-wait for a busy core)."""
    random.seed(seed)
    import numpy as np

    np.random.seed(seed % 2**32)
    if torch_threads is not None:
        import torch

        torch.manual_seed(seed)
        torch.set_num_threads(torch_threads)


@functools.cache
def source_state(root: Path = ROOT) -> tuple[str, bool]:
    """(commit, dirty) of the checkout: dirty when code differs from the commit (results and docs do not count:
    a bench run writes results, and the next bench of the suite is still the same code)."""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=30, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", ".", ":!bench/results",
                                 ":!docs"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown", False
    return commit, bool(status.strip())


def git_head(root: Path) -> str:
    """Another checkout's commit for an A/B record, with "+changes" when its code differs from it."""
    commit, dirty = source_state(root.resolve())
    return commit + ("+changes" if dirty else "")


def jsonable(value: Any) -> Any:
    """Settings as JSON: paths as strings, tuples as lists."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


# --- Discovery without importing --------------------------------------------------------------------------

@dataclass(frozen=True)
class Declared:
    """A bench as its module declares it, read from the source."""

    name: str
    module: str
    """What ``python -m`` runs, e.g. ``bench.wanemu.measure``."""
    tags: tuple[str, ...]
    cores: int
    summary: str
    """The first line of the module's docstring."""


def declared_benches(directory: Path = BENCH_DIR) -> list[Declared]:
    """Every module under ``directory`` with a module-level ``BENCH = Bench(...)``, by module. Read, not imported:
    importing every bench takes tens of seconds (torch, transformers, numba) and run_all runs each in a process
    of its own anyway. tests/bench checks this reading against the imported registry."""
    found = []
    for path in sorted(directory.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["BENCH"] \
                    and isinstance(node.value, ast.Call):
                module = ".".join(("bench", *path.relative_to(directory).with_suffix("").parts))
                found.append(_declared(path, module, tree, node.value))
    return found


def _declared(path: Path, module: str, tree: ast.Module, call: ast.Call) -> Declared:
    keywords = {k.arg: k.value for k in call.keywords if k.arg}
    try:
        name = ast.literal_eval(call.args[0] if call.args else keywords["name"])
        tags = tuple(ast.literal_eval(keywords["tags"]))
        cores = ast.literal_eval(keywords["cores"]) if "cores" in keywords else 2
    except (ValueError, KeyError, IndexError) as exc:
        raise ValueError(f"{path}: BENCH = Bench(...) needs a literal name, tags= and cores= ({exc})") from None
    doc = (ast.get_docstring(tree) or "").strip()
    return Declared(name, module, tags, cores, doc.splitlines()[0] if doc else "")
