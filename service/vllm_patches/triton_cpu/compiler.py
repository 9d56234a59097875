"""Compiler half of the interpreter-only ``cpu`` Triton backend: it supports no target.

``supports_target`` returning False is what keeps torch inductor on its C++ CPU codegen instead
of trying to compile Triton for a backend that cannot compile.
"""

# Loaded by Triton's backend discovery (triton.backends.__init__); importing this module before
# triton.backends is a circular import, so always go through ``triton.backends.backends['cpu']``.

from __future__ import annotations

from triton.backends.compiler import BaseBackend, GPUTarget


class CpuInterpreterBackend(BaseBackend):
    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return False

    def hash(self) -> str:
        return "routereplay-cpu-interpreter"

    def parse_options(self, options: dict) -> object:
        raise NotImplementedError("the cpu backend only runs kernels under TRITON_INTERPRET=1")

    def add_stages(self, stages: dict, options: object, language) -> None:
        raise NotImplementedError("the cpu backend only runs kernels under TRITON_INTERPRET=1")

    def load_dialects(self, context) -> None:
        return None

    def get_module_map(self) -> dict:
        return {}
