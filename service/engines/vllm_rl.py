"""The RL control API on the in-process vLLM engine: pause and resume, the weight version and
transfer, and checkpoint reloads with their checks and the restore after a failed load."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..engine import PauseMode, RLControl
from ..errors import EngineUnavailableError, ServiceError
from .checkpoints import (
    Checkpoint,
    CheckpointError,
    check_compatible,
    check_unchanged,
    read_checkpoint,
)
from .one_at_a_time import OneAtATime
from .vllm_host import local_model_dir

if TYPE_CHECKING:
    from .vllm import VllmBackend

__all__ = ["VllmRL"]

log = logging.getLogger("routereplay.service")

T = TypeVar("T")


class VllmRL(RLControl):
    """The RL API on the in-process ``AsyncLLM``: the same engine calls vLLM's own server makes.

    Every call that changes the engine's state (pause, resume, the weight version, the weight
    transfer, loads) runs one at a time (:class:`OneAtATime`); a weight change moves the
    weights generation (``service/admission.py``) before generation resumes, under the new
    version.

    Weight transfer backends (``init_weight_transfer_engine`` / ``update_weights``): vLLM's
    ``nccl``, ``ipc`` (CUDA IPC), ``sparse_nccl`` and ``nccl_m2n`` need GPUs; set the backend with
    ``--engine-args '{"weight_transfer_config": {"backend": "ipc"}}'``. On a CPU host, or whenever
    the new weights are on disk, :meth:`reload_weights` loads a checkpoint directory in place.
    """

    def __init__(self, backend: VllmBackend) -> None:
        self.b = backend
        self._ops = OneAtATime()
        self._last_change: dict[str, Any] | None = None
        self._served: Checkpoint | None = None
        self._good: Path | None = None  # the weights last loaded whole (first: the served model)
        self._good_root: Path | None = None  # the weights root _good was loaded under, if any

    @property
    def engine(self) -> Any:
        if self.b.engine is None or self.b.dead:
            raise EngineUnavailableError("the engine is not running", code="engine_dead")
        return self.b.engine

    def _one(self, op: str, work: Callable[[], Awaitable[T]], **what: Any) -> Awaitable[T]:
        return self._ops.run({"op": op, **what}, work)

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        await self._one("pause", lambda: self._pause(mode, clear_cache), mode=mode)

    async def _pause(self, mode: PauseMode, clear_cache: bool) -> None:
        admission = self.b.admission
        was_held = admission.held
        admission.hold()  # new requests wait in the service until /resume
        try:
            await self.engine.pause_generation(mode=mode, clear_cache=clear_cache)
        except BaseException:
            if not was_held:
                admission.release_hold()
            raise

    async def resume(self) -> None:
        await self._one("resume", self._resume)

    async def _resume(self) -> None:
        await self.engine.resume_generation()
        self.b.admission.release_hold()

    async def is_paused(self) -> bool:
        return bool(await self.engine.is_paused())

    async def abort_requests(self, request_ids: list[str] | None) -> int:
        # Not ordered with the other calls: an abort is always safe, and it is what ends a
        # /pause?mode=wait that waits on long requests.
        wanted = set(request_ids or ())
        tickets = self.b.admission.tickets()
        ids = [t.engine_id for t in tickets if not wanted or t.client_id in wanted]
        if ids:
            await self.engine.abort(ids)
        return len(ids)

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        request = WeightTransferInitRequest(init_info=init_info)
        await self._one("init_weight_transfer_engine",
                        lambda: self.engine.init_weight_transfer_engine(request))  # fmt: skip

    async def shutdown_weight_transfer_engine(self) -> None:
        release = self.b.release
        if release is not None and not release.transfer_shutdown:
            raise NotImplementedError(
                f"vLLM {release.version} has no shutdown_weight_transfer_engine (vLLM 0.32+)"
            )
        await self._one("shutdown_weight_transfer_engine",
                        lambda: self.engine.shutdown_weight_transfer_engine())  # fmt: skip

    async def start_weight_update(self) -> None:
        await self._one("start_weight_update", self._start_weight_update)

    async def _start_weight_update(self) -> None:
        await self.engine.start_weight_update()
        # From here the weights are partly new: nothing computed now may serve a later request.
        await self._weights_changed()

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        request = WeightTransferUpdateRequest(update_info=update_info)
        await self._one("update_weights", lambda: self.engine.update_weights(request))

    async def finish_weight_update(self, weight_version: str | None) -> None:
        # The version is set by _changing_weights, before generation resumes.
        work = lambda: self._changing_weights(  # noqa: E731
            lambda: self.engine.finish_weight_update(None), weight_version
        )
        await self._one("finish_weight_update", self._tracked(work),
                        weight_version=weight_version)  # fmt: skip

    async def update_weight_version(self, new_version: str) -> None:
        # A new label for the same weights: the cache they computed stays theirs.
        await self._one("update_weight_version", lambda: self._relabelled(new_version),
                        weight_version=new_version)  # fmt: skip

    async def _relabelled(self, new_version: str) -> None:
        try:
            await self.engine.update_weight_version(new_version)
        finally:
            await self.b.relabel()

    async def weight_version(self) -> str:
        return str(await self.engine.get_weight_version())

    def weight_update_status(self) -> dict[str, Any]:
        return {"running": self._ops.running, "last_weight_change": self._last_change}

    async def reload_weights(
        self, checkpoint: Path, weight_version: str | None, root: Path
    ) -> None:
        work = lambda: self._reload(checkpoint, weight_version, root)  # noqa: E731
        await self._one("reload_weights", self._tracked(work), weights_path=str(checkpoint),
                        weight_version=weight_version)  # fmt: skip

    def _tracked(self, work: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        """``work`` recorded as the last weight change (what a caller that timed out reads on
        ``GET /weight_update``) once it ends."""

        async def tracked() -> None:
            change = dict(self._ops.running or {})
            state, error = "failed", None
            try:
                await work()
                state = "done"
            except BaseException as e:
                error = e.message if isinstance(e, ServiceError) else f"{type(e).__name__}: {e}"
                raise
            finally:
                self._last_change = {**change, "state": state, "error": error,
                                     "finished_at": time.time()}  # fmt: skip

        return tracked

    async def _changing_weights(
        self, change: Callable[[], Awaitable[None]], weight_version: str | None
    ) -> None:
        """Run ``change`` with generation stopped (running requests frozen, as under
        ``/pause?mode=keep``; new ones held in the service), then, before anything runs again:
        label the new weights, move the weights generation and take back the requests that
        have not started. A service that was paused stays paused."""
        engine, admission = self.engine, self.b.admission
        was_held, was_paused = admission.held, bool(await engine.is_paused())
        admission.hold()
        if not was_paused:
            await engine.pause_generation(mode="keep", clear_cache=False)
        try:
            await change()
            if weight_version is not None:
                await engine.update_weight_version(weight_version)
        finally:
            if not self.b.dead:
                await self._weights_changed()
                await self.b.relabel()
                if not was_paused:
                    await engine.resume_generation()
            if not was_held:
                admission.release_hold()

    async def _weights_changed(self) -> None:
        """A new weights generation: requests of the old one that have produced nothing are
        taken back (aborted here, submitted again under the new one); then the prefix cache is
        cleared where the engine allows it (memory only: the generation keeps it apart)."""
        admission = self.b.admission
        taken = admission.advance()
        await admission.settle(taken)
        if taken:
            # Also reaches a request whose submission was still on its way when it was taken.
            await self.engine.abort([t.engine_id for t in taken])
            log.info("weights changed: %d request(s) not yet started resubmitted", len(taken))
        cleared = bool(await self.engine.reset_prefix_cache())
        self.b.prefix_cache_resets["cleared" if cleared else "refused"] += 1
        if cleared:
            log.info("weights generation %d: prefix cache cleared", admission.generation)
        else:
            log.warning(
                "weights generation %d: the engine kept its prefix cache (requests hold KV "
                "blocks); its blocks serve no request of the new generation",
                admission.generation,
            )

    async def _reload(self, checkpoint: Path, weight_version: str | None, root: Path) -> None:
        fmt = self._load_format()
        new = await asyncio.to_thread(read_checkpoint, checkpoint, root, fmt)
        check_compatible(new, await self._served_checkpoint())
        # vLLM frees the old tensors before it reads the new ones: no step may run in between.
        await self._changing_weights(lambda: self._load(checkpoint, root, new), weight_version)

    def _load_format(self) -> str:
        """The engine's load format: it decides which files of a checkpoint vLLM reads."""
        return str(self.engine.vllm_config.load_config.load_format)

    async def _served_checkpoint(self) -> Checkpoint:
        """The headers of the checkpoint the engine booted from: what every load must match."""
        if self._served is None:
            fmt = self._load_format()
            path = await asyncio.to_thread(local_model_dir, self.b.model)
            try:
                self._served = await asyncio.to_thread(read_checkpoint, path, None, fmt)
            except CheckpointError as e:
                raise CheckpointError(
                    f"the served model's own checkpoint ({self.b.model}) cannot be read, so no "
                    f"checkpoint can be checked against it: {e.message}",
                    code="served_model_unreadable",
                ) from e
            self._good, self._good_root = path, None
        return self._served

    async def _load(self, checkpoint: Path, root: Path, read: Checkpoint | None = None) -> None:
        """Load ``checkpoint`` in the engine. With ``read`` (what the checks read), vLLM, which
        opens the files again by name, must find those same files: checked right before the
        load (a change refuses it, nothing released yet) and right after (a change restores)."""
        if read is not None:
            await asyncio.to_thread(check_unchanged, read)
        try:
            await self.engine.collective_rpc(
                "reload_weights", kwargs={"weights_path": str(checkpoint)}
            )
            if read is not None:
                await asyncio.to_thread(check_unchanged, read)
        except Exception as e:
            log.error("loading %s failed: %s; restoring %s", checkpoint, e, self._good)
            await self._restore()
            version = await self.engine.get_weight_version()
            why = e.message if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            raise CheckpointError(
                f"the engine could not load {str(checkpoint)!r} ({why}); the previous weights "
                f"({version!r}) are restored and serving",
                code="checkpoint_load_failed",
            ) from e
        self._good, self._good_root = checkpoint, root

    async def _restore(self) -> None:
        """Load the last good weights again, checked as any load, or stop the service (exit
        status 3): the engine holds released tensors and would die on its next step."""
        good = self._good
        try:
            assert good is not None and self._served is not None
            fmt = self._load_format()
            read = await asyncio.to_thread(read_checkpoint, good, self._good_root, fmt)
            check_compatible(read, self._served)
            await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(good)})
            await asyncio.to_thread(check_unchanged, read)
        except Exception as e:
            reason = f"restoring the last good weights ({good}) failed: {type(e).__name__}: {e}"
            self.b.fail(reason)
            raise EngineUnavailableError(
                f"reload_weights: {reason}; the service exits with status 3", code="engine_dead"
            ) from e
        log.warning("restored the last good weights from %s", good)

    async def world_size(self, include_dp: bool) -> int:
        pc = self.engine.vllm_config.parallel_config
        return int(pc.world_size_across_dp if include_dp else pc.world_size)
