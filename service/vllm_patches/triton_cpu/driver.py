"""Driver half of the interpreter-only ``cpu`` Triton backend (see the package docstring)."""

# Loaded by Triton's backend discovery (triton.backends.__init__); importing this module before
# triton.backends is a circular import, so always go through ``triton.backends.backends['cpu']``.

from __future__ import annotations

import os

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class CpuInterpreterDriver(DriverBase):
    """Reports a ``cpu`` target; launches nothing (the interpreter runs kernels itself)."""

    @classmethod
    def is_active(cls) -> bool:
        # Only with the interpreter on: a compiled launch path does not exist here.
        return os.environ.get("TRITON_INTERPRET", "0") == "1"

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", 0, 0)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        return None

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_device_interface(self):
        import torch

        return torch.cpu

    def get_benchmarker(self):
        from triton.testing import do_bench

        return do_bench

    def get_empty_cache_for_benchmark(self):
        import torch

        return torch.empty(1, dtype=torch.int8)

    def clear_cache(self, cache) -> None:
        cache.zero_()
