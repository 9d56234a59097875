"""The repository's promises hold: README commands match CI, deploy files name real settings
and paths, and the client installs without the heavy stacks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from routereplay.service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(bash scripts/setup\.sh && [^\n]+)\n```", text)


def test_readme_has_the_two_setup_commands_and_ci_runs_the_test_one() -> None:
    cmds = _readme_commands()
    assert len(cmds) == 2, cmds
    serve, test = cmds
    assert "routereplay serve" in serve
    assert "pytest" in test
    assert test in (ROOT / ".ci" / "run").read_text()


def _env_names() -> set[str]:
    """Every ROUTEREPLAY_* name the deploy files set (other names are for interpolation)."""
    names: set[str] = set()
    for f in [ROOT / "compose.yaml", *(ROOT / "deploy").glob("compose*.yaml")]:
        names |= set(re.findall(r"^\s+(ROUTEREPLAY_[A-Z_]+):", f.read_text(), re.M))
    for f in (ROOT / "deploy" / "k8s").glob("*.yaml"):
        for doc in yaml.safe_load_all(f.read_text()):
            if doc.get("kind") == "ConfigMap":
                names |= set(doc["data"])
            for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                names |= {e["name"] for e in c.get("env", [])}
    for f in (ROOT / "docker").glob("Dockerfile*"):
        names |= set(re.findall(r"\b(ROUTEREPLAY_[A-Z_]+)=", f.read_text()))
    return {n for n in names if n.startswith("ROUTEREPLAY_")}


def test_deploy_files_only_set_real_settings() -> None:
    fields = {f"ROUTEREPLAY_{n.upper()}" for n in Settings.model_fields}
    names = _env_names()
    assert names, "no ROUTEREPLAY_* variables found in deploy files"
    assert names <= fields, f"unknown settings: {sorted(names - fields)}"


def test_every_routereplay_variable_named_is_a_setting_or_tooling() -> None:
    """The rule the service enforces at start, kept true of what the project itself names:
    outside the tests, a ROUTEREPLAY_* name is a setting or one of TOOLING_VARIABLES."""
    from routereplay.service.settings import TOOLING_VARIABLES

    known = {f"ROUTEREPLAY_{n.upper()}" for n in Settings.model_fields} | TOOLING_VARIABLES.keys()
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()  # fmt: skip
    named: dict[str, str] = {}
    for f in files:
        path = ROOT / f
        if f.startswith("tests/") or not path.is_file() or path.suffix in (".png", ".tgz"):
            continue
        for line in path.read_text("utf-8", "replace").splitlines():
            if "is not a setting" in line:  # the refusal itself, quoted in the docs
                continue
            for name in re.findall(r"\bROUTEREPLAY_[A-Z0-9_]*[A-Z0-9]\b", line):
                named.setdefault(name, f)
    assert "ROUTEREPLAY_REDIS_URL" in named  # the scan reads the files
    assert {n: f for n, f in named.items() if n not in known} == {}


def test_dockerfiles_copy_existing_paths() -> None:
    for f in (ROOT / "docker").glob("Dockerfile*"):
        for line in f.read_text().splitlines():
            if line.startswith("COPY ") and "--from=" not in line:
                for src in line.split()[1:-1]:
                    assert (ROOT / src).exists(), f"{f.name}: COPY {src} does not exist"


def test_client_imports_without_service_or_trainer_stacks() -> None:
    code = (
        "import sys, routereplay.client\n"
        "heavy = {'torch', 'vllm', 'megatron', 'fastapi', 'transformers'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_package_is_in_the_wheel() -> None:
    """pyproject lists packages explicitly (their directories are remapped): a subpackage left
    out works in an editable install and is missing from the wheel and the images."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {v: k for k, v in cfg["package-dir"].items()}
    found = set()
    for d, pkg in dirs.items():
        for init in (ROOT / d).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / d).parts
            found.add(".".join((pkg, *rel)))
    assert found == set(cfg["packages"]), found ^ set(cfg["packages"])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel the standard build backend makes of this checkout's files (copied: a stale
    ``build/`` of an earlier install would otherwise slip old modules into it)."""
    import shutil

    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)],
        check=True,
    )  # fmt: skip
    (whl,) = out.glob("*.whl")
    return whl


def test_nothing_for_tests_is_in_the_wheel(wheel: Path) -> None:
    """The scheduler's test hold is a distribution of its own (tests/plugins): the wheel has no
    module that parks requests, and its vLLM plugins are the service's two."""
    import zipfile

    z = zipfile.ZipFile(wheel)
    names = z.namelist()
    assert not [n for n in names if "hold" in n.rsplit("/", 1)[-1]], names
    py = [n for n in names if n.endswith(".py")]
    assert not [n for n in py if b"Scheduler.schedule =" in z.read(n)]
    assert not [n for n in names if n.startswith("tests/")]
    (eps,) = [n for n in names if n.endswith("entry_points.txt")]
    plugins = z.read(eps).decode().split("[vllm.general_plugins]", 1)[1].split("[", 1)[0]
    assert sorted(line.split("=")[0].strip() for line in plugins.splitlines() if "=" in line) == [
        "routereplay_capture", "routereplay_cpu_sampling"]  # fmt: skip


def test_the_wheel_is_pure_python(wheel: Path) -> None:
    """One implementation, in Python: the wheel the standard build backend makes is
    ``py3-none-any`` and holds no compiled module or C source, and the repository holds no C."""
    import zipfile

    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert "routereplay/client/_chunks.py" in names
    native = [n for n in names if n.endswith((".so", ".pyd", ".c", ".h", ".pyx"))]
    assert not native, native
    tracked = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "*.c", "*.h", "*.cc", "*.cpp", "*.pyx"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert not tracked, tracked
