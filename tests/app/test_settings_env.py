"""Settings as people type them: every list setting from the environment comma-separated and as
JSON, the same through flags, and a bad value a one-line usage error naming its variable (or flag)
and the form it takes. ``cpu_bind`` stays inside this process's CPU affinity."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from routereplay.service.cli import UsageError, settings_from_argv
from routereplay.service.env_settings import LIST_FORM, container_of
from routereplay.service.settings import Settings
from routereplay.service.vllm_patches.cpu_setup import omp_threads_bind, set_omp_threads_bind

ALICE = "alice:0123456789abcdef"
BOB = "bob:fedcba9876543210-x"

# Two valid items per list-valued setting; a test below fails when a list setting is added
# without an entry here.
LIST_ITEMS: dict[str, list[str]] = {"api_keys": [ALICE, BOB], "admin_keys": [BOB, ALICE]}


def values(field: str, s: Settings) -> list[str]:
    return [getattr(v, "get_secret_value", lambda v=v: v)() for v in getattr(s, field)]


def variable(field: str) -> str:
    return f"ROUTEREPLAY_{field.upper()}"


def usage_error(argv: list[str] | None = None) -> str:
    with pytest.raises(UsageError) as e:
        settings_from_argv(argv or [])
    return str(e.value)


def test_every_list_setting_is_covered() -> None:
    lists = {n for n, f in Settings.model_fields.items() if container_of(f) is list}
    assert lists == set(LIST_ITEMS)


@pytest.mark.parametrize("field", sorted(LIST_ITEMS))
@pytest.mark.parametrize(
    "form",
    [
        lambda items: ",".join(items),
        lambda items: " , ".join(items) + ",",  # spaces and a trailing comma
        json.dumps,
    ],
    ids=["comma", "comma-loose", "json"],
)
def test_env_list_comma_separated_or_json(field: str, form, monkeypatch) -> None:
    monkeypatch.setenv(variable(field), form(LIST_ITEMS[field]))
    assert values(field, settings_from_argv([])) == LIST_ITEMS[field]


@pytest.mark.parametrize("field", sorted(LIST_ITEMS))
def test_env_list_empty_is_no_items(field: str, monkeypatch) -> None:
    monkeypatch.setenv(variable(field), "")
    assert values(field, settings_from_argv([])) == []


@pytest.mark.parametrize("field", sorted(LIST_ITEMS))
def test_flag_list_comma_repeated_or_json(field: str) -> None:
    flag = "--" + field.replace("_", "-")
    items = LIST_ITEMS[field]
    for argv in (
        [flag, ",".join(items)],
        [x for item in items for x in (flag, item)],
        [flag, json.dumps(items)],
    ):
        assert values(field, settings_from_argv(argv)) == items, argv


@pytest.mark.parametrize("field", sorted(LIST_ITEMS))
@pytest.mark.parametrize(
    "raw, problem",
    [
        ('["alice:0123456789abcdef"', "not valid JSON (Expecting ',' delimiter at column 26)"),
        ('{"a": 1}', "a JSON object, not a list"),
        ("[1]", "item 1: Input should be a valid string"),
        (f"{ALICE},carol:short", "item 2: the key of tenant 'carol' is shorter than 16"),
        (f"bad tenant!:{'x' * 16}", "item 1: tenant name 'bad tenant!' must match"),
    ],
    ids=["broken-json", "object", "not-a-string", "short-key", "bad-tenant"],
)
def test_env_list_bad_values_name_the_variable(field: str, raw: str, problem: str, monkeypatch):
    monkeypatch.setenv(variable(field), raw)
    msg = usage_error()
    assert msg.startswith(variable(field)), msg
    assert problem in msg, msg
    assert "\n" not in msg
    # Keys are secrets: a bad one is described, never echoed.
    assert "0123456789abcdef" not in msg and "x" * 16 not in msg, msg


def test_env_list_bad_form_says_the_forms(monkeypatch) -> None:
    monkeypatch.setenv("ROUTEREPLAY_API_KEYS", '["a"')
    assert usage_error() == (
        "ROUTEREPLAY_API_KEYS: not valid JSON (Expecting ',' delimiter at column 5); "
        f"expected {LIST_FORM}"
    )
    monkeypatch.setenv("ROUTEREPLAY_API_KEYS", "[1]")
    assert usage_error() == (
        f"ROUTEREPLAY_API_KEYS item 1: Input should be a valid string; expected {LIST_FORM}"
    )


def test_flag_bad_item_names_the_flag_even_with_the_variable_set(monkeypatch) -> None:
    monkeypatch.setenv("ROUTEREPLAY_API_KEYS", ALICE)
    msg = usage_error(["--api-keys", "carol:short"])
    assert msg.startswith("--api-keys item 1: the key of tenant 'carol'"), msg


def test_flag_bad_forms_name_the_flag() -> None:
    assert usage_error(["--api-keys", '["a"']) == (
        f'--api-keys: Missing end delimiter "]"; expected {LIST_FORM}'
    )
    assert usage_error(["--engine-args", "{bad"]).startswith("--engine-args: Missing end delimiter")
    assert usage_error(["--engine-args", "{bad"]).endswith(
        """expected a JSON object ('{"key": value}')"""
    )


def test_env_dict_json(monkeypatch) -> None:
    monkeypatch.setenv("ROUTEREPLAY_ENGINE_ARGS", '{"max_num_seqs": 8, "kv_cache_dtype": "auto"}')
    assert settings_from_argv([]).engine_args == {"max_num_seqs": 8, "kv_cache_dtype": "auto"}


@pytest.mark.parametrize(
    "raw, problem",
    [
        ("{max_num_seqs: 8}", "not valid JSON (Expecting property name enclosed in double quotes"),
        ("max_num_seqs=8", "not valid JSON (Expecting value at column 1)"),
        ("[1, 2]", "a JSON list, not an object"),
    ],
)
def test_env_dict_bad_values_name_the_variable(raw: str, problem: str, monkeypatch) -> None:
    monkeypatch.setenv("ROUTEREPLAY_ENGINE_ARGS", raw)
    msg = usage_error()
    assert msg.startswith(f"ROUTEREPLAY_ENGINE_ARGS: {problem}"), msg
    assert msg.endswith("""expected a JSON object ('{"key": value}')"""), msg


def test_env_scalar_bad_value_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("ROUTEREPLAY_PORT", "eighty")
    assert usage_error().startswith("ROUTEREPLAY_PORT: Input should be a valid integer")
    assert usage_error(["--port", "x"]).startswith("--port: Input should be a valid integer")


def run_serve(*flags: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "routereplay.cli", "serve", *flags],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )  # fmt: skip


def test_serve_exits_with_one_line_and_status_2() -> None:
    """The message of the issue that asked for this, as `routereplay serve` prints it now."""
    r = run_serve(env={"ROUTEREPLAY_ENGINE_ARGS": "{bad"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        "routereplay serve: error: ROUTEREPLAY_ENGINE_ARGS: not valid JSON (Expecting property "
        """name enclosed in double quotes at column 2); expected a JSON object ('{"key": value}')"""
    ]


def test_help_says_the_forms() -> None:
    out = " ".join(run_serve("--help", env={}).stdout.split())  # unwrapped
    assert "comma-separated or a JSON list" in out and "--cpu-bind" in out
    assert "Lists are comma-separated" in out


@pytest.mark.parametrize(
    ("name", "line"),
    [
        ("ROUTEREPLAY_PROT", "ROUTEREPLAY_PROT is not a setting (did you mean ROUTEREPLAY_PORT?)"),
        ("routereplay_redis_ulr", "routereplay_redis_ulr is not a setting (did you mean "
                                  "ROUTEREPLAY_REDIS_URL?)"),
        ("ROUTEREPLAY_TEST_HOLD_DIR", "ROUTEREPLAY_TEST_HOLD_DIR is not a setting"),
    ],
)  # fmt: skip
def test_serve_refuses_a_variable_that_is_no_setting(name: str, line: str) -> None:
    """A typo'd ROUTEREPLAY_* name would leave its setting at the default: refused at start,
    as an unknown request field is, with the closest setting's name."""
    r = run_serve("--backend", "synthetic", env={name: "1"})
    assert r.returncode == 2, r.stderr
    [out] = r.stderr.splitlines()
    assert out.startswith(f"routereplay serve: error: {line}"), out
    if "did you mean" not in line:
        assert "did you mean" not in out


def test_tooling_variables_are_not_settings_and_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    from routereplay.service.settings import TOOLING_VARIABLES, unknown_variables

    fields = {f"ROUTEREPLAY_{n.upper()}" for n in Settings.model_fields}
    assert not TOOLING_VARIABLES.keys() & fields
    env = {name: "x" for name in TOOLING_VARIABLES} | {"ROUTEREPLAY_PORT": "1", "RR_OTHER": "1"}
    assert unknown_variables(env) == []
    for name in TOOLING_VARIABLES:
        monkeypatch.setenv(name, "x")
    assert settings_from_argv(["--port", "9"]).port == 9


# -- cpu_bind --------------------------------------------------------------------------------------


def test_cpu_bind_values() -> None:
    assert omp_threads_bind("auto") == "auto"
    assert omp_threads_bind("none") == "nobind"
    assert omp_threads_bind("2-3", allowed={0, 1, 2, 3}) == "2-3"
    assert omp_threads_bind("0-1|2-3", allowed={0, 1, 2, 3}) == "0-1|2-3"
    with pytest.raises(ValueError, match=r"cores \[4, 5\] are outside"):
        omp_threads_bind("2-5", allowed={0, 1, 2, 3})


def test_cpu_bind_for_tensor_parallel_ranks() -> None:
    """vLLM's auto binds one rank per NUMA node; auto here splits the allowed cores."""
    assert omp_threads_bind("auto", allowed={0, 1}, ranks=2) == "0|1"
    assert omp_threads_bind("auto", allowed={0, 1, 2, 3, 4}, ranks=2) == "0,1|2,3"  # 4: scheduler
    assert omp_threads_bind("auto", allowed=set(range(8)), ranks=4) == "0,1|2,3|4,5|6"  # 7 too
    with pytest.raises(ValueError, match=r"2 tensor-parallel ranks need a core each"):
        omp_threads_bind("auto", allowed={3}, ranks=2)
    assert omp_threads_bind("0|1", allowed={0, 1}, ranks=2) == "0|1"
    with pytest.raises(ValueError, match=r"names 1 core list\(s\) for an engine of 2"):
        omp_threads_bind("0-1", allowed={0, 1}, ranks=2)
    assert omp_threads_bind("none", ranks=2) == "nobind"


def test_cpu_bind_setting_reaches_the_variable_vllm_reads(monkeypatch) -> None:
    core = str(min(os.sched_getaffinity(0)))
    monkeypatch.setenv("ROUTEREPLAY_CPU_BIND", core)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert set_omp_threads_bind(settings_from_argv([]).cpu_bind) == core
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == core
    set_omp_threads_bind(settings_from_argv(["--cpu-bind", "none"]).cpu_bind)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_cpu_bind_bad_values(monkeypatch) -> None:
    monkeypatch.setenv("ROUTEREPLAY_CPU_BIND", "cores 2 and 3")
    assert usage_error().startswith("ROUTEREPLAY_CPU_BIND: expected auto, none or a CPU list")
    outside = max(os.sched_getaffinity(0)) + 1
    assert usage_error(["--cpu-bind", str(outside)]).startswith(
        f"--cpu-bind: cores [{outside}] are outside this process's CPU affinity"
    )


# vLLM's own choice of worker cores for a binding value, in a process that inherits an affinity.
_VLLM_BINDING = """
import os, sys, types
from routereplay.service.vllm_patches.cpu_setup import set_omp_threads_bind
from routereplay.service.settings import Settings
set_omp_threads_bind(Settings().cpu_bind)
from vllm.utils.ompmultiprocessing import OMPProcessManager
parallel = types.SimpleNamespace(local_world_size=1, data_parallel_rank_local=None,
                                 _api_process_count=1)
manager = OMPProcessManager(types.SimpleNamespace(parallel_config=parallel,
                                                  kv_transfer_config=None))
print(sorted(os.sched_getaffinity(0)), manager.cpu_lists[0])
"""


@pytest.mark.skipif(
    shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2,
    reason="needs taskset and two cores",
)
@pytest.mark.slow  # starts a CPU engine worker
@pytest.mark.parametrize("cpu_bind", ["auto", None])
def test_worker_cores_follow_the_affinity(cpu_bind: str | None) -> None:
    """Under `taskset -c CORE` (as under a cgroup cpuset) the engine's worker threads go to
    CORE, whatever core another instance on the host was given."""
    pytest.importorskip("vllm")
    env = {**os.environ, "ROUTEREPLAY_CPU_BIND": cpu_bind} if cpu_bind else dict(os.environ)
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if cpu_bind is None:
        env.pop("ROUTEREPLAY_CPU_BIND", None)
    for core in sorted(os.sched_getaffinity(0))[-2:]:
        r = subprocess.run(
            ["taskset", "-c", str(core), sys.executable, "-c", _VLLM_BINDING],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.splitlines()[-1] == f"[{core}] [{core}]", r.stdout
