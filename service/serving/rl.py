"""Serving the RL control API: pause and resume generation, weight updates, weight versions.

The paths, bodies and answers are vLLM's (``vllm/entrypoints/rl/online/api_router.py``), so an RL
framework drives this service as it drives ``vllm serve``; the calls go to the engine backend's
:class:`~..engine.RLControl`. Engine failures become errors in the one schema: a request the
engine cannot use, or an operation this engine does not have (``not_supported``), is a 400:
the request cannot succeed here, and retrying will not change that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

from ..engine import EngineBackend, PauseMode, RLControl
from ..engines.checkpoints import CheckpointError, resolve_checkpoint
from ..errors import EngineUnavailableError, InvalidRequestError, ServiceError
from ..metrics import ServiceMetrics

__all__ = ["NotSupportedError", "ServingRL"]

log = logging.getLogger("routereplay.service")

T = TypeVar("T")


class NotSupportedError(ServiceError):
    status_code = 400
    type = "invalid_request_error"
    default_code = "not_supported"


class ServingRL:
    def __init__(
        self, backend: EngineBackend, metrics: ServiceMetrics, weights_root: Path | None = None
    ) -> None:
        self.backend = backend
        self.metrics = metrics
        self.weights_root = weights_root  # file-based weight loads read only under it

    @property
    def rl(self) -> RLControl:
        rl = self.backend.rl
        if rl is None:
            raise NotSupportedError("this engine backend has no RL control API")
        return rl

    async def _op(self, name: str, work: Awaitable[T]) -> T:
        """Run one engine operation, timed and counted, its failures as clear errors."""
        t0 = time.perf_counter()
        status = "ok"
        try:
            return await work
        except ServiceError as e:
            status = e.code
            raise
        except NotImplementedError as e:
            status = "not_supported"
            raise NotSupportedError(f"{name}: {e}") from e
        except (ValueError, TypeError, KeyError, AssertionError) as e:
            status = "invalid"
            raise InvalidRequestError(f"{name}: {type(e).__name__}: {e}", code="rl_invalid") from e
        except Exception as e:
            # The engine refused the call; whatever it was, the caller's request did it (a
            # dead engine is a 503, below): a 400 naming the engine's reason, never a 500.
            status = "error"
            log.exception("RL operation %s failed", name)
            if self.backend.dead:
                raise EngineUnavailableError(
                    f"{name}: the engine died ({type(e).__name__}: {e})", code="engine_dead"
                ) from e
            raise InvalidRequestError(
                f"{name} failed in the engine: {type(e).__name__}: {e}", code="rl_failed"
            ) from e
        finally:
            self.metrics.rl_ops.labels(op=name, status=status).inc()
            self.metrics.rl_latency.labels(op=name).observe(time.perf_counter() - t0)

    async def pause(self, mode: PauseMode, clear_cache: bool) -> dict[str, Any]:
        await self._op("pause", self.rl.pause(mode, clear_cache))
        return {"status": "paused"}

    async def resume(self) -> dict[str, Any]:
        await self._op("resume", self.rl.resume())
        return {"status": "resumed"}

    async def is_paused(self) -> dict[str, Any]:
        return {"is_paused": await self._op("is_paused", self.rl.is_paused())}

    async def abort_requests(self, request_ids: list[str] | None) -> dict[str, Any]:
        n = await self._op("abort_requests", self.rl.abort_requests(request_ids))
        return {"status": "aborted", "aborted": n}

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> dict[str, Any]:
        await self._op("init", self.rl.init_weight_transfer_engine(init_info))
        return {"message": "Weight transfer initialized"}

    async def shutdown_weight_transfer_engine(self) -> dict[str, Any]:
        await self._op("shutdown", self.rl.shutdown_weight_transfer_engine())
        return {"message": "Weight transfer shut down"}

    async def start_weight_update(self) -> dict[str, Any]:
        await self._op("start", self.rl.start_weight_update())
        return {"message": "Weight update started"}

    async def update_weights(self, update_info: dict[str, Any]) -> dict[str, Any]:
        await self._op("update", self.rl.update_weights(update_info))
        return {"message": "Weights updated"}

    async def finish_weight_update(self, weight_version: str | None) -> dict[str, Any]:
        await self._op("finish", self.rl.finish_weight_update(weight_version))
        return {"message": "Weight update finished"}

    async def update_weight_version(self, new_version: str) -> dict[str, Any]:
        await self._op("update_weight_version", self.rl.update_weight_version(new_version))
        return {"success": True, "new_version": new_version}

    async def weight_info(self) -> dict[str, Any]:
        return {"weight_version": await self._op("weight_info", self.rl.weight_version())}

    async def weight_update(self) -> dict[str, Any]:
        status = self.rl.weight_update_status()
        if status is None:
            raise NotSupportedError("this engine backend does not track weight updates")
        version = await self._op("weight_info", self.rl.weight_version())
        return {"weight_version": version, **status}

    async def reload_weights(self, weights_path: str, weight_version: str | None) -> dict[str, Any]:
        rl = self.rl
        try:
            path = await asyncio.to_thread(resolve_checkpoint, weights_path, self.weights_root)
        except CheckpointError as e:
            self.metrics.rl_ops.labels(op="reload", status=e.code).inc()
            raise
        assert self.weights_root is not None  # resolve_checkpoint refuses loads without one
        await self._op("reload", rl.reload_weights(path, weight_version, self.weights_root))
        version = await self._op("weight_info", self.rl.weight_version())
        return {"message": "Weights reloaded", "weight_version": version}

    async def world_size(self, include_dp: bool) -> dict[str, Any]:
        return {"world_size": await self._op("get_world_size", self.rl.world_size(include_dp))}
