"""A small record for template-made Python functions, and the check that runs them."""
from __future__ import annotations

import copy
import math
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Param:
    name: str
    type: str
    doc: str


@dataclass(frozen=True)
class PyFunction:
    """One self-contained function, its documentation parts and a way to check it."""

    family: str
    name: str
    params: tuple[Param, ...]
    returns: str
    summary: str
    returns_doc: str
    body: str
    oracle: Callable[..., Any]
    cases: tuple[tuple, ...]
    imports: tuple[str, ...] = field(default=())

    @property
    def signature(self) -> str:
        args = ", ".join(f"{p.name}: {p.type}" for p in self.params)
        return f"{self.name}({args}) -> {self.returns}"

    @property
    def code(self) -> str:
        """The full source: imports, a blank gap, then the def with its body."""
        head = "".join(f"{line}\n" for line in self.imports)
        gap = "\n\n" if self.imports else ""
        body = textwrap.indent(textwrap.dedent(self.body).strip("\n"), "    ")
        return f"{head}{gap}def {self.signature}:\n{body}\n"


def fn(family: str, name: str, params: list[tuple[str, str, str]], returns: str, summary: str,
       returns_doc: str, body: str, oracle: Callable[..., Any], cases: list[tuple],
       imports: tuple[str, ...] = ()) -> PyFunction:
    """Shorthand constructor used by the catalogues."""
    return PyFunction(family, name, tuple(Param(*p) for p in params), returns, summary,
                      returns_doc, body, oracle, tuple(cases), imports)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(
            a, b, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def check(func: PyFunction) -> None:
    """Run the generated code on every case and compare with the independent oracle."""
    namespace: dict[str, Any] = {}
    exec(compile(func.code, f"<{func.name}>", "exec"), namespace)  # noqa: S102 - our own templates
    impl = namespace[func.name]
    if len(func.code.splitlines()) > 25:
        raise AssertionError(f"{func.name}: longer than 25 lines")
    for case in func.cases:
        got = impl(*copy.deepcopy(case))
        want = func.oracle(*copy.deepcopy(case))
        if not _same(got, want):
            raise AssertionError(f"{func.name}{case!r}: got {got!r}, want {want!r}")
