"""The project's shape, held: no two files of the coordinator import each other; its rooms (subpackages) import
only downwards, in ROOMS' order; no class of the project has more than 25 methods.

Read from the source with ``ast`` (nothing is imported), so a cycle held apart by a function-level import
counts too.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "coordinator"
MAX_METHODS = 25
NOT_SIZED = ("tests", "docs", "requirements")
"""Top-level folders whose classes are not held to MAX_METHODS (tests group test functions; the others hold no code)."""
ROOMS = ("storage", "aggregation", "checks", "access", "http", "api", "relay")
"""The coordinator's subpackages, lowest first: a room imports only rooms before it. storage (rows, blobs, uploads,
the audit log's table) knows no other room; aggregation (the update rules, pure functions) neither, and checks (what
an update must pass) only those rules; access (tokens, auth, the audit events) stands on storage and checks; http (the server) on storage's body records; api (the Flask app, its admission and
upload placement) on all of them; a relay reuses everything. The coordinator's top-level files (the domain:
service, steps, config ...) are not a room."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
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


def _room(module: str) -> str | None:
    """``coordinator.storage.manifest`` -> "storage"; None for a top-level file of the coordinator."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else None


def room_arrows_upwards(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a room to a room at or above it in ROOMS (a room not in ROOMS is above them all)."""
    rank = {room: i for i, room in enumerate(ROOMS)}
    wrong = []
    for source, targets in graph.items():
        for target in targets:
            a, b = _room(source), _room(target)
            if a is not None and b is not None and a != b and rank.get(a, len(ROOMS)) <= rank.get(b, len(ROOMS)):
                wrong.append(f"{source} -> {target}")
    return sorted(wrong)


def test_the_rooms_of_the_coordinator_import_only_rooms_below_them():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    rooms = {path.parent.relative_to(PACKAGE).parts[0] for path in PACKAGE.glob("*/__init__.py")}
    assert rooms == set(ROOMS)  # a new room is placed in ROOMS, with its reason
    assert room_arrows_upwards(graph) == []


def test_an_import_up_the_rooms_is_seen():
    """The check above can fail: storage -> http (the arrow this order removed) and http -> api are caught."""
    graph = {"coordinator.storage.upload_files": {"coordinator.http.bodies", "coordinator.storage.blobs"},
             "coordinator.http.admission": {"coordinator.api.requests"}, "coordinator.api.routes": {"coordinator.service"}}
    assert room_arrows_upwards(graph) == ["coordinator.http.admission -> coordinator.api.requests",
                                          "coordinator.storage.upload_files -> coordinator.http.bodies"]


def _sized_files() -> list[Path]:
    files = list(ROOT.glob("*.py"))
    for folder in sorted(p for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if folder.name not in NOT_SIZED and not folder.is_symlink():
            files += folder.rglob("*.py")
    return files


def test_no_class_of_the_project_has_more_than_25_methods():
    wide, seen = {}, 0
    for path in _sized_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                seen += 1
                n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if n > MAX_METHODS:
                    wide[f"{path.relative_to(ROOT)}:{node.name}"] = n
    assert seen > 400  # the walk saw the project's classes (FederatedWorker, Wire, Transport, SecureAggregator ...)
    assert wide == {}
