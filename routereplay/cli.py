"""``routereplay`` command line: one entry point, subcommands imported lazily.

Lazy imports keep ``routereplay bench store`` usable with only the light client installed.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> "module:function"; each function takes the remaining argv and returns an exit code.
_COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("routereplay.service.cli:serve_main", "run the OpenAI-compatible capture service"),
    "build-model": (
        "routereplay.service.cli:build_model_main",
        "build the tiny deterministic Qwen3-MoE model used by the embedded default",
    ),
    "bench": (
        "routereplay.cli:_bench_main",
        "benchmarks: store | service | trainer | routes | scale | tp | json | capture",
    ),
    "experiment": (
        "routereplay.cli:_experiment_main",
        "experiments: rl-loop | mismatch | versions",
    ),
    "report": (
        "routereplay.report:main",
        "an HTML page of the routing: expert load per weight version, trainer coverage",
    ),
    "loadtest": (
        "routereplay.bench.loadtest:main",
        "load a running service and verify every route it stored",
    ),
}

_EXPERIMENTS: dict[str, str] = {
    "rl-loop": "routereplay.experiments.rl_loop:main",
    "mismatch": "routereplay.experiments.mismatch:main",
    "versions": "routereplay.experiments.versions:main",
}

_BENCHES: dict[str, str] = {
    "store": "routereplay.bench.store:main",
    "service": "routereplay.bench.service:main",
    "trainer": "routereplay.bench.trainer:main",
    "routes": "routereplay.bench.routes:main",
    "scale": "routereplay.bench.scale:main",
    "tp": "routereplay.bench.tp:main",
    "json": "routereplay.bench.route_json:main",
    "capture": "routereplay.bench.capture:main",
}


def _load(target: str):
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def _bench_main(argv: list[str]) -> int:
    if argv and argv[0] in _BENCHES:
        # The rest, --help included, belongs to the benchmark itself.
        return int(_load(_BENCHES[argv[0]])(argv[1:]) or 0)
    p = argparse.ArgumentParser(prog="routereplay bench")
    p.add_argument("which", choices=sorted(_BENCHES))
    p.parse_args(argv)  # prints usage / the error and exits
    return 2


def _experiment_main(argv: list[str]) -> int:
    if argv and argv[0] in _EXPERIMENTS:
        return int(_load(_EXPERIMENTS[argv[0]])(argv[1:]) or 0)
    p = argparse.ArgumentParser(prog="routereplay experiment")
    p.add_argument("which", choices=sorted(_EXPERIMENTS))
    p.parse_args(argv)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        print("usage: routereplay <command> [options]\n\ncommands:")
        for name, (_, helptext) in _COMMANDS.items():
            print(f"  {name:12s} {helptext}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return int(_load(_COMMANDS[argv[0]][0])(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
