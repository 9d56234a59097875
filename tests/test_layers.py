"""Layer edges hold: each layer imports only the layers below it, across layers only through
public names (a package's ``__all__``), and the light client ships no tooling.

    client, local_redis              (nothing of ours)
    service                          -> client, local_redis
    trainer_adapter                  -> client
    bench, experiments, report, cli  -> anything (tooling above every layer)
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Source directory -> the package it installs as.
LAYERS = {
    "client": "client",
    "service": "service",
    "trainer_adapter": "trainer_adapter",
    "routereplay/local_redis.py": "local_redis",
    "routereplay/bench": "bench",
    "routereplay/experiments": "experiments",
    "routereplay/cli.py": "cli",
    "routereplay/report.py": "report",
}
ALLOWED = {
    "client": set(),
    "local_redis": set(),
    "service": {"client", "local_redis"},
    "trainer_adapter": {"client"},
    "bench": {"client", "service", "trainer_adapter", "local_redis"},
    # report runs with only its extra (matplotlib) beside the client: no service, no Prometheus
    "report": {"client"},
    "experiments": {"client", "service", "trainer_adapter", "local_redis", "bench", "report"},
    "cli": {"client", "service", "trainer_adapter", "local_redis", "bench", "experiments"},
}


def _files() -> list[tuple[str, Path]]:
    out = []
    for src, layer in LAYERS.items():
        p = ROOT / src
        out += [(layer, f) for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
    return out


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """``(module, names, line)`` of every absolute ``routereplay`` import in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "routereplay":
                out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "routereplay":
                    out.append((a.name, [], node.lineno))
    return out


def test_layers_import_downward_through_public_names() -> None:
    problems = []
    for layer, path in _files():
        for module, names, line in _imports(path):
            parts = module.split(".")
            target = parts[1] if len(parts) > 1 else None
            where = f"{path.relative_to(ROOT)}:{line}: {module}"
            if target is None or target == layer:
                continue
            if target not in ALLOWED[layer]:
                problems.append(f"{where}: layer {layer} may not import {target}")
                continue
            if any(p.startswith("_") for p in parts[2:]):
                problems.append(f"{where}: private module of another layer")
                continue
            public = getattr(importlib.import_module(module), "__all__", None)
            for n in names:
                if n.startswith("_") or (
                    public is not None and len(parts) == 2 and n not in public
                ):
                    problems.append(f"{where}: {n} is not a public name of {module}")
    assert not problems, "\n".join(problems)


def test_client_ships_no_tooling() -> None:
    for f in (ROOT / "client").glob("*.py"):
        text = f.read_text()
        for banned in ("subprocess", "argparse", "def main("):
            assert banned not in text, (
                f"{f.name} contains {banned!r}: tooling belongs in routereplay/bench"
            )


def _vllm_imports(path: Path) -> list[int]:
    """Lines of ``path`` that import vLLM (``vllm`` or one of its modules)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if any(n == "vllm" or n.startswith("vllm.") for n in names):
            lines.append(node.lineno)
    return lines


def test_vllm_is_imported_only_in_its_rooms() -> None:
    # What depends on vLLM is service/engines (its engine API) and service/vllm_patches (its
    # internals): the HTTP layer, the capture and the settings run without it.
    rooms = (ROOT / "service" / "engines", ROOT / "service" / "vllm_patches")
    found = [
        f"{f.relative_to(ROOT)}:{line}"
        for f in sorted((ROOT / "service").rglob("*.py"))
        if not any(f.is_relative_to(r) for r in rooms)
        for line in _vllm_imports(f)
    ]
    assert not found, f"vLLM imported outside service/engines and service/vllm_patches: {found}"
    assert _vllm_imports(ROOT / "service" / "engines" / "vllm.py")  # the check sees imports


def test_tooling_modules_share_only_public_names() -> None:
    # The benchmarks and experiments are standalone tools: what one lends another is a public
    # name of its module, so a private helper can change without breaking a sibling.
    problems = []
    for d in ("routereplay/bench", "routereplay/experiments"):
        for f in sorted((ROOT / d).glob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                ours = isinstance(node, ast.ImportFrom) and (
                    node.level or (node.module or "").split(".")[0] == "routereplay"
                )
                private = [a.name for a in node.names if a.name.startswith("_")] if ours else []
                if private:
                    problems.append(f"{f.relative_to(ROOT)}:{node.lineno}: {private}")
    assert not problems, "\n".join(problems)


def test_every_relative_import_resolves() -> None:
    # Imports inside functions run only on their path (an engine start, a CPU host): a module
    # moved without its lazy importers updated would fail there, not at import time.
    problems = []
    for src, pkg in (
        ("service", "service"),
        ("client", "client"),
        ("trainer_adapter", "trainer_adapter"),
    ):
        for f in sorted((ROOT / src).rglob("*.py")):
            rel = f.relative_to(ROOT / src).with_suffix("").parts
            here = ["routereplay", pkg, *rel[:-1]]  # the package a module (or __init__) is in
            for node in ast.walk(ast.parse(f.read_text())):
                if not (isinstance(node, ast.ImportFrom) and node.level):
                    continue
                base = here[: len(here) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
                try:
                    m = importlib.import_module(module)
                    for a in node.names:
                        if not hasattr(m, a.name):
                            importlib.import_module(f"{module}.{a.name}")
                except ImportError as e:
                    problems.append(f"{f.relative_to(ROOT)}:{node.lineno}: {e}")
    assert not problems, "\n".join(problems)
