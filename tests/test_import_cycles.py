"""No import cycle among the shipped modules: each module is a room with clear walls, and the
modules it imports sit below it, never beside it in a ring.

The shipped modules are the packages ``pyproject.toml`` lists, found through its ``package-dir``
map, and each one's ``.py`` files. They are read with :mod:`ast` only: nothing is imported, so the
test takes milliseconds and needs none of the optional stacks.

What is an edge from module A to module B:

- ``import routereplay.x.y``, ``from routereplay.x import y`` and the relative forms
  (``from . import y``, ``from .x import y``, ``from .. import y``). ``from P import y`` is an
  edge to the submodule ``P.y`` when ``y`` is one, else to ``P`` (a name its ``__init__`` holds).
- Not the parent packages Python loads on the way to a submodule: every package's ``__init__``
  imports its own submodules, so counting them would make each package a cycle.
- Not an import under ``if TYPE_CHECKING:`` (never executed; annotations only).

Module-level imports (class bodies, ``try`` and ``if`` blocks included) are the walls: a strongly
connected component of two or more modules, or a module importing itself, fails the test.

An import inside a function runs late, so it breaks no import at start-up, and a lazy import is
how heavy stacks stay unloaded until used (``trainer_adapter``'s ``__getattr__``). But a lazy
import that closes a ring (A imports B inside a function while B imports A at module level) is the
same two-way dependency with the cycle hidden from the import system. Finding those is cheap (one
reachability search per lazy edge), so they fail the test too.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    lazy: bool  # inside a function: runs when it is called, not when ``source`` loads


def shipped_modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of every package pyproject ships."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs: dict[str, str] = setuptools["package-dir"]
    out: dict[str, Path] = {}
    for package in setuptools["packages"]:
        parts = package.split(".")
        for n in range(len(parts), 0, -1):
            base = ".".join(parts[:n])
            if base in dirs:
                directory = ROOT / dirs[base] / Path(*parts[n:])
                break
        else:
            directory = ROOT / Path(*parts)
        for f in directory.glob("*.py"):
            out[package if f.stem == "__init__" else f"{package}.{f.stem}"] = f
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(
    node: ast.AST, lazy: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under ``node`` with whether it runs lazily (inside a function),
    skipping the bodies of ``if TYPE_CHECKING:``."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, lazy
        return
    lazy = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        children: Iterable[ast.AST] = node.orelse
    else:
        children = ast.iter_child_nodes(node)
    for child in children:
        yield from _import_nodes(child, lazy)


def module_edges(name: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """The edges from module ``name`` (source ``path``) to other shipped modules."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node, lazy in _import_nodes(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                known = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
                targets += [m for m in known if m in modules][:1]
        else:
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                if sub in modules:
                    targets.append(sub)
                elif origin in modules:
                    targets.append(origin)
        out += [Edge(name, t, node.lineno, lazy) for t in dict.fromkeys(targets)]
    return out


def _components(nodes: list[str], succ: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of the graph ``succ``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    for v in nodes:
        if v not in index:
            visit(v)
    return out


def _path(succ: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A shortest path ``start`` -> ``goal`` in ``succ`` (breadth first), or None."""
    parent: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(succ.get(v, ())):
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        if goal in parent:
            path = [goal]
            while (p := parent[path[-1]]) is not None:
                path.append(p)
            return path[::-1]
        frontier = nxt
    return None


def import_cycles(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    """One message per cycle: each module-level ring (with the import lines that form it), and
    each lazy import that closes a ring over module-level imports."""
    edges = [e for name, path in modules.items() for e in module_edges(name, path, modules)]
    succ: dict[str, set[str]] = {}
    for e in edges:
        if not e.lazy:
            succ.setdefault(e.source, set()).add(e.target)

    def where(e: Edge) -> str:
        rel = modules[e.source].relative_to(root)
        kind = "lazily imports" if e.lazy else "imports"
        return f"{rel}:{e.line} {kind} {e.target}"

    problems = []
    for component in _components(sorted(modules), succ):
        ring = set(component)
        inside = [e for e in edges if not e.lazy and e.source in ring and e.target in ring]
        if len(component) > 1 or inside:
            lines = "\n    ".join(where(e) for e in inside)
            problems.append(f"import cycle among {', '.join(component)}:\n    {lines}")
    for e in edges:
        if e.lazy and e.source != e.target and (back := _path(succ, e.target, e.source)):
            problems.append(
                f"{where(e)}, which imports it back at module level ({' -> '.join(back)}): "
                "a cycle behind a function-level import"
            )
    return problems


def test_shipped_modules_import_no_cycle() -> None:
    modules = shipped_modules()
    # the map from pyproject resolves: every package's __init__ is found
    assert {"routereplay", "routereplay.client", "routereplay.service.auth"} <= set(modules)
    problems = import_cycles(modules)
    assert not problems, "\n".join(problems)


def test_the_check_sees_module_level_and_lazy_rings(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    files = {
        "__init__": "from . import a\nfrom .b import B\n",
        "a": "from typing import TYPE_CHECKING\nfrom .b import B\n"
        "if TYPE_CHECKING:\n    from .c import C\n",
        "b": "from . import c\nB = 1\n",
        "c": "from pkg.a import A\n",  # closes a -> b -> c -> a
        "d": "import pkg.e\n",
        "e": "def f():\n    from .d import D\n",  # lazy: closes e -> d -> e
        "f": "def f():\n    from . import a\n",  # lazy, no ring
    }
    for name, text in files.items():
        (pkg / f"{name}.py").write_text(text)
    modules = {("pkg" if p.stem == "__init__" else f"pkg.{p.stem}"): p for p in pkg.glob("*.py")}
    problems = import_cycles(modules, tmp_path)
    assert len(problems) == 2, problems
    assert problems[0].startswith("import cycle among pkg.a, pkg.b, pkg.c:")
    assert "pkg/e.py:2 lazily imports pkg.d" in problems[1]
    assert "pkg.d -> pkg.e" in problems[1]
