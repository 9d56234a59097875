"""No function in the shipped packages is longer than 80 lines: a longer one is split where it
has a seam (named helpers that each do one thing), not by cutting lines."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 80


def _shipped_dirs() -> list[Path]:
    """The source directories of the packages the wheel ships (pyproject's package-dir)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return sorted({ROOT / d for d in cfg["package-dir"].values()})


def _long_functions(source: str) -> list[tuple[int, str, int]]:
    """``(line, name, lines)`` of each function or method in ``source`` (nested ones too) over
    the limit; a function's lines run from its ``def`` (decorators not counted) to its last
    line, docstring included."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_LINES:
                out.append((node.lineno, node.name, n))
    return out


def test_the_shipped_packages_are_found() -> None:
    dirs = _shipped_dirs()
    assert {d.name for d in dirs} >= {"routereplay", "client", "service", "trainer_adapter"}
    assert all((d / "__init__.py").is_file() for d in dirs), dirs


def _function(name: str, lines: int, indent: str = "") -> str:
    """Source of a function ``lines`` long, its ``def`` line included."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))
    return f"{indent}def {name}():\n{body}"


def test_the_measure_counts_from_def_to_the_last_line() -> None:
    assert _long_functions("@property\n" + _function("f", MAX_LINES)) == []
    method = "class C:\n" + _function("g", MAX_LINES + 1, indent="    ")
    assert _long_functions(method) == [(2, "g", MAX_LINES + 1)]


def test_no_function_is_longer_than_80_lines() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line} {name} ({n} lines)"
        for d in _shipped_dirs()
        for path in sorted(d.rglob("*.py"))
        for line, name, n in _long_functions(path.read_text())
    ]
    assert not offenders, f"functions over {MAX_LINES} lines:\n" + "\n".join(offenders)
