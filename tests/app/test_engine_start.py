"""What the in-process engine backend does before and right after vLLM starts, checked without
starting it: the engine arguments (every default the service sets yields to ``--engine-args``),
the environment vLLM's processes get on CPU and GPU hosts (spawn; the CPU engine's variables
only on CPU), host detection that never touches ``torch.cuda`` (which would poison a fork), the
plugin checks that refuse to serve without the capture, and a weights plane that is missing
from the engine's rows never costing a route its ids.

vLLM's own ``AsyncEngineArgs`` is built for real; nothing here starts an engine.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from routereplay.bench.servers import engine_env as bench_engine_env
from routereplay.service.cli import UsageError, settings_from_argv
from routereplay.service.engine import ChoiceFinished
from routereplay.service.engines.vllm import VllmBackend
from routereplay.service.engines.vllm_host import engine_env, on_cpu_host
from routereplay.service.errors import StartupRefused
from routereplay.service.model_info import ModelInfo
from routereplay.service.settings import RESERVED_ENGINE_ARGS
from routereplay.service.vllm_patches.plugins import (
    CAPTURE_PLUGIN,
    CPU_SAMPLING_PLUGIN,
    PluginMissing,
    ask_workers,
    check_installed,
    check_workers,
)
from routereplay.service.vllm_patches.route_weights import split_routes

# Each field the service sets from its own settings, and a value no default has.
OVERRIDES: dict[str, Any] = {
    "dtype": "bfloat16",
    "max_model_len": 333,
    "seed": 1234,
    "gpu_memory_utilization": 0.3,
    "enforce_eager": True,
    "tensor_parallel_size": 2,
}


def backend(**kw: Any) -> VllmBackend:
    return VllmBackend("/nonexistent/model", served_model_name="m", **kw)


def test_every_service_default_is_listed() -> None:
    # A field added to what the service sets must be added to OVERRIDES (and so tested).
    assert set(backend()._kw) == set(OVERRIDES)


@pytest.mark.parametrize("cpu", [True, False], ids=["cpu", "gpu"])
@pytest.mark.parametrize("field", sorted(OVERRIDES))
def test_engine_args_override_each_service_default(field: str, cpu: bool) -> None:
    args = backend(extra_engine_args={field: OVERRIDES[field]}).engine_args(cpu)
    assert getattr(args, field) == OVERRIDES[field]
    assert args.enable_return_routed_experts and args.enable_prefix_caching


def test_engine_args_defaults_per_host() -> None:
    cpu, gpu = backend().engine_args(True), backend().engine_args(False)
    assert (cpu.gpu_memory_utilization, cpu.enforce_eager) == (0.5, True)
    assert (gpu.gpu_memory_utilization, gpu.enforce_eager) == (0.9, False)
    # The service's own settings still apply where --engine-args says nothing.
    args = backend(dtype="float32", max_model_len=99, extra_engine_args={"seed": 5})
    a = args.engine_args(False)
    assert (a.dtype, a.max_model_len, a.seed) == ("float32", 99, 5)


def test_engine_args_unknown_field_refused_by_name() -> None:
    with pytest.raises(StartupRefused, match=r"--engine-args: 'no_such_field' not a field"):
        backend(extra_engine_args={"no_such_field": 1, "seed": 2}).engine_args(True)


@pytest.mark.parametrize("key", sorted(RESERVED_ENGINE_ARGS))
def test_engine_args_the_service_owns_are_a_usage_error(key: str) -> None:
    with pytest.raises(UsageError, match=rf"--engine-args: '{key}' is set by the service"):
        settings_from_argv(["--engine-args", f'{{"{key}": "x"}}'])


def test_engine_args_flag_takes_gpu_memory_utilization() -> None:
    s = settings_from_argv(["--engine-args", '{"gpu_memory_utilization": 0.3}'])
    assert backend(extra_engine_args=s.engine_args).engine_args(False).gpu_memory_utilization == 0.3


def test_engine_env_spawns_on_every_host_and_keeps_cpu_variables_to_cpu() -> None:
    gpu, cpu = engine_env(False), engine_env(True)
    assert gpu["VLLM_WORKER_MULTIPROC_METHOD"] == cpu["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    for k in ("TRITON_INTERPRET", "VLLM_USE_V2_MODEL_RUNNER", "VLLM_CPU_KVCACHE_SPACE"):
        assert k not in gpu and k in cpu


@pytest.fixture()
def without_vllm_cpu(monkeypatch) -> None:
    """As on a host with the CUDA vLLM: the vllm-cpu distribution is not installed."""
    import importlib.metadata

    real_version = importlib.metadata.version

    def no_vllm_cpu(dist: str) -> str:
        if dist == "vllm-cpu":
            raise importlib.metadata.PackageNotFoundError(dist)
        return real_version(dist)

    monkeypatch.setattr(importlib.metadata, "version", no_vllm_cpu)


def test_a_broken_vllm_is_refused_not_taken_for_a_cpu_host(
    monkeypatch, without_vllm_cpu: None
) -> None:
    """vLLM installed but failing to import (a CUDA library missing, a half-upgraded install)
    must not read as "no GPU here": the service would start a CPU engine on a GPU host."""
    import types

    # A vllm.platforms without current_platform: "cannot import name", an ImportError.
    monkeypatch.setitem(sys.modules, "vllm.platforms", types.ModuleType("vllm.platforms"))
    with pytest.raises(StartupRefused, match=r"vLLM is installed but vllm.platforms does not"):
        on_cpu_host()


def test_bench_servers_get_the_cpu_environment_only_on_cpu(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET" not in bench_engine_env(cpu=False)
    assert bench_engine_env(cpu=True)["TRITON_INTERPRET"] == "1"
    assert bench_engine_env(cpu=False, X_EXTRA="1")["X_EXTRA"] == "1"


def test_host_detection_never_asks_torch_cuda(monkeypatch, without_vllm_cpu: None) -> None:
    """``torch.cuda.is_available()`` would mark this process so that vLLM's forked engine core
    cannot use CUDA; the detection must go through vLLM's platform (NVML) instead."""
    import torch

    calls: list[str] = []
    for name in ("is_available", "device_count", "init", "is_initialized"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, **k: calls.append(_n) or False)
    assert on_cpu_host() is True  # vLLM's own platform detection: this host has no GPU
    assert calls == []


def test_plugins_must_be_installed_and_allowed() -> None:
    check_installed([CAPTURE_PLUGIN, CPU_SAMPLING_PLUGIN], environ={})
    with pytest.raises(PluginMissing, match=r"VLLM_PLUGINS='other' does not name"):
        check_installed([CAPTURE_PLUGIN], environ={"VLLM_PLUGINS": "other"})
    with pytest.raises(PluginMissing, match=r"VLLM_PLUGINS='' does not name"):
        check_installed([CPU_SAMPLING_PLUGIN], environ={"VLLM_PLUGINS": ""})
    check_installed([CAPTURE_PLUGIN], environ={"VLLM_PLUGINS": f"x, {CAPTURE_PLUGIN}"})
    with pytest.raises(PluginMissing, match=r"'routereplay_nope' is not installed"):
        check_installed(["routereplay_nope"], environ={})


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("routereplay.service._vllm_cpu_plugin:register", "points at"),  # a module since removed
        ("routereplay.service.vllm_patches.plugins:register_cpu_sampling", "points at"),  # swapped
    ],
)
def test_a_stale_plugin_entry_point_is_refused(value: str, words: str) -> None:
    from importlib.metadata import EntryPoint

    stale = [EntryPoint(CAPTURE_PLUGIN, value, "vllm.general_plugins")]
    with pytest.raises(PluginMissing, match=words) as e:
        check_installed([CAPTURE_PLUGIN], environ={}, found=stale)
    assert "stale: reinstall it" in str(e.value) and "\n" not in str(e.value)


def test_a_plugin_that_does_not_load_is_refused() -> None:
    from importlib.metadata import EntryPoint

    gone = [EntryPoint("routereplay_other", "routereplay.service._gone:f", "vllm.general_plugins")]
    with pytest.raises(PluginMissing, match=r"does not load \(ModuleNotFoundError"):
        check_installed(["routereplay_other"], environ={}, found=gone)


def test_a_failed_weights_patch_is_reported_as_itself(monkeypatch) -> None:
    """The status method registers first: a worker whose weights patch raised says so, rather
    than passing for a worker that never loaded the plugin."""
    from routereplay.service.vllm_patches import plugins as _vllm_plugins
    from routereplay.service.vllm_patches import route_weights as _route_weights

    def broken() -> None:
        raise RuntimeError("symbol moved")

    from vllm.v1.worker.worker_base import WorkerWrapperBase

    monkeypatch.setattr(_route_weights, "maybe_install", broken)
    # Restored (removed) after the test: register_capture sets it on vLLM's class.
    monkeypatch.setattr(WorkerWrapperBase, "routereplay_capture_status", None, raising=False)
    _vllm_plugins.register_capture()

    status = WorkerWrapperBase.routereplay_capture_status(None)  # type: ignore[attr-defined]
    assert status["failed"] == {"route_weights": "RuntimeError: symbol moved"}
    with pytest.raises(PluginMissing, match=r"installing it failed: RuntimeError: symbol moved"):
        check_workers([status], route_weights=True)


def test_a_plain_install_has_no_scheduler_hold() -> None:
    """Only routereplay's own plugins, as a deployment has them: whatever the environment names,
    nothing wraps vLLM's scheduler."""
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.v1.core.sched.scheduler import Scheduler\n"
        "assert not getattr(Scheduler.schedule, '_routereplay_hold', False)\n"
        "print('unwrapped')\n"
    )
    env = {**os.environ, "VLLM_PLUGINS": f"{CAPTURE_PLUGIN},{CPU_SAMPLING_PLUGIN}",
           "RR_TEST_HOLD_DIR": "/tmp", "ROUTEREPLAY_TEST_HOLD_DIR": "/tmp"}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0 and "unwrapped" in out.stdout, out.stderr[-2000:]


def test_backend_refuses_weights_when_vllm_plugins_excludes_the_capture(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", CPU_SAMPLING_PLUGIN)
    with pytest.raises(StartupRefused, match=rf"does not name '{CAPTURE_PLUGIN}'"):
        backend(route_weights="on")._check_plugins(cpu=True)
    backend(route_weights="off")._check_plugins(cpu=True)  # ids need no plugin of ours


class _Engine:
    """What ``ask_workers`` calls on vLLM's AsyncLLM: the answers of its workers."""

    def __init__(self, answers: Any) -> None:
        self.answers = answers

    async def collective_rpc(self, method: str) -> Any:
        assert method == "routereplay_capture_status"
        if isinstance(self.answers, Exception):
            raise self.answers
        return self.answers


def test_worker_answers() -> None:
    ok = {"pid": 1, "route_weights": True}
    check_workers([ok, ok], route_weights=True)
    check_workers([{"pid": 1, "route_weights": False}], route_weights=False)
    with pytest.raises(PluginMissing, match=r"worker 1 \(pid 2\) has no routing-weight capture"):
        check_workers([ok, {"pid": 2, "route_weights": False}], route_weights=True)
    with pytest.raises(PluginMissing, match="no workers"):
        check_workers([], route_weights=True)
    err = RuntimeError("Worker failed with error 'no attribute routereplay_capture_status'")
    with pytest.raises(PluginMissing, match=r"did not load the 'routereplay_capture' plugin"):
        asyncio.run(ask_workers(_Engine(err), route_weights=True))


def _weights_backend() -> VllmBackend:
    b = backend(route_weights="on")
    b.info = ModelInfo(
        name="m", num_layers=2, moe_layers=[0, 1], num_experts=8, top_k=2, max_model_len=64
    )
    return b


def _finished(routes: np.ndarray) -> ChoiceFinished:
    return ChoiceFinished(0, "length", None, [5], 0, routes)


def test_ids_without_weights_plane_fail_the_route() -> None:
    """The start-up check refuses a worker without the weights capture; rows of vLLM's own
    uint8 ids reaching a backend that has it on break that check's word: the route fails,
    naming the layout, and nothing is stored as if it were whole."""
    ids = np.array([[[1, 2], [3, 4]], [[5, 6], [7, 0]]], dtype=np.uint8)
    for wanted in (True, False):
        fin = asyncio.run(_weights_backend()._split_weights(_finished(ids.copy()), wanted))
        assert fin.routed_experts is None and fin.routed_weights is None
        assert "not the routing-weight capture's [rows, layers, 4] int32" in fin.routes_error


def test_the_patch_table_names_what_this_vllm_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every object the capture touches is one row of SYMBOLS: this vLLM has each (the check
    passes), and a row naming something it lacks, or a replaced function it lacks, is refused
    by its full name."""
    from routereplay.service.vllm_patches import route_weights as rw

    rw.check_supported()
    gone = rw.Symbol("vllm.v1.worker.worker_base", "NoSuchWrapper")
    monkeypatch.setattr(rw, "SYMBOLS", (*rw.SYMBOLS, gone))
    with pytest.raises(rw.RouteWeightsUnsupported, match=r"has no vllm\.v1\.worker\.worker_base"
                       r"\.NoSuchWrapper$"):  # fmt: skip
        rw.check_supported()
    method = rw.Symbol(rw.SYMBOLS[0].module, "BaseRouter", "_no_such_step", replaced=True)
    monkeypatch.setattr(rw, "SYMBOLS", (*rw.SYMBOLS[:-1], method))
    reviewed = {r: {**s, "BaseRouter._no_such_step": "0" * 16} for r, s in rw.REVIEWED.items()}
    monkeypatch.setattr(rw, "REVIEWED", reviewed)
    with pytest.raises(rw.RouteWeightsUnsupported, match=r"BaseRouter\._no_such_step .*missing"):
        rw.check_supported()


def test_swapped_id_and_weight_slots_are_refused_before_narrowing() -> None:
    """Weights in the id slots: the float bits of 0.75 and 0.25 narrowed to uint8 are 0 and 0,
    plausible ids; checked as int32 they are out of range."""
    w = np.array([0.75, 0.25], dtype=np.float32).view(np.int32)
    row = np.concatenate([w, np.array([3, 5], dtype=np.int32)])
    wide = np.broadcast_to(row, (4, 2, 4)).copy()
    with pytest.raises(ValueError, match=r"expert ids in \[\d+, \d+\] outside \[0, 8\)"):
        split_routes(wide, 2, 8)
    ok = np.concatenate([np.array([3, 5], dtype=np.int32), w])
    ids, weights = split_routes(np.broadcast_to(ok, (4, 2, 4)).copy(), 2, 8)
    assert ids.dtype == np.uint8 and (ids == [3, 5]).all() and (weights == [0.75, 0.25]).all()
    same, none = split_routes(np.broadcast_to(ok, (4, 2, 4)).copy(), 2, 8, weights=False)
    assert none is None and np.array_equal(same, ids)  # no weights copy unless asked


def test_data_and_expert_parallel_on_a_cpu_host_are_refused_at_start() -> None:
    """vLLM's CPU workers start DP = 2 and EP = 2 and end the engine on its first request (no
    all_gatherv in the CPU communicator; the CPU fused-MoE kernel faults on a part of the
    experts): refused before the engine starts, tensor parallel alone served."""
    from types import SimpleNamespace

    from routereplay.service.engines.vllm import _check_cpu_layout
    from routereplay.service.errors import StartupRefused

    with pytest.raises(StartupRefused, match=r"data_parallel_size=2 on a CPU host.*all_gatherv"):
        _check_cpu_layout(SimpleNamespace(data_parallel_size=2))
    with pytest.raises(StartupRefused, match=r"enable_expert_parallel on a CPU host.*faults"):
        _check_cpu_layout(SimpleNamespace(data_parallel_size=1, enable_expert_parallel=True))
    _check_cpu_layout(SimpleNamespace(data_parallel_size=1, tensor_parallel_size=2,
                                      enable_expert_parallel=False))  # fmt: skip
