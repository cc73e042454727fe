"""The coordinator's shape, held: no two files import each other; no class over 25 methods in the packages of SIZED.

Read from the source with ``ast`` (nothing is imported), so a cycle held apart by a function-level import
counts too. coordinator/http/ is left out of the cycle check until its own cycle (front <-> connection <->
receiving) is gone; its classes are sized like the rest.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "coordinator"
MAX_METHODS = 25
SIZED = ("coordinator", "worker")
"""The packages whose classes are held to MAX_METHODS (protocol/ waits for CoordinatorClient's split)."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if "http" in parts:
            continue
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports, wherever in the file (``from a import b`` names module a.b if it is one)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            out |= subs or ({node.module} & modules.keys())
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted(component + [v]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_two_files_of_the_coordinator_import_each_other():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # the walk saw the package and its imports
    assert _cycles(graph) == []


def test_no_class_of_the_sized_packages_has_more_than_25_methods():
    wide, seen = {}, 0
    for path in (path for package in SIZED for path in (ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                seen += 1
                n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if n > MAX_METHODS:
                    wide[f"{path.relative_to(ROOT)}:{node.name}"] = n
    assert seen > 150  # the walk saw the packages' classes (FederatedWorker, Wire, ExpertStore ...)
    assert wide == {}
