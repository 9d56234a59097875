"""vLLM's RL control API (admin keys only): ``/pause``, ``/resume``, ``/is_paused``,
``/abort_requests``, the weight-transfer calls, ``/update_weight_version``, ``/weight_info``,
``/get_world_size``; plus ``/reload_weights`` (routereplay: load a checkpoint directory, the
weight update that works without GPUs)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Query, Request

from ..auth import Principal, principal
from ..errors import error_responses
from ..http_limits import JSONRoute
from ..serving.rl import ServingRL
from ..state import service_state

__all__ = ["router"]


def require_admin(who: Annotated[Principal, Depends(principal)]) -> Principal:
    if not who.admin:
        from ..auth import PermissionDeniedError

        raise PermissionDeniedError(
            "the RL control API needs an admin key (--admin-keys); a service without keys "
            "opens it only with --unsafe-no-auth"
        )
    return who


router = APIRouter(
    tags=["RL control (vLLM's API)"],
    route_class=JSONRoute,
    dependencies=[Depends(require_admin)],
    responses=error_responses(400, 401, 403, 503),
)


def rl(raw_request: Request) -> ServingRL:
    return service_state(raw_request).rl


@router.post("/pause")
async def pause(
    raw_request: Request,
    mode: Annotated[Literal["abort", "wait", "keep"], Query()] = "abort",
    clear_cache: Annotated[bool, Query()] = True,
) -> dict[str, Any]:
    """Stop generation for a weight update: ``abort`` running requests, ``wait`` for them, or
    ``keep`` them frozen (they finish after /resume under the new weights; their routes then
    carry both versions' spans)."""
    return await rl(raw_request).pause(mode, clear_cache)


@router.post("/resume")
async def resume(raw_request: Request) -> dict[str, Any]:
    return await rl(raw_request).resume()


@router.get("/is_paused")
async def is_paused(raw_request: Request) -> dict[str, Any]:
    return await rl(raw_request).is_paused()


@router.post("/abort_requests")
async def abort_requests(
    raw_request: Request,
    request_ids: Annotated[list[str] | None, Body(embed=True)] = None,
) -> dict[str, Any]:
    """Abort these (client) request ids, or every request in flight."""
    return await rl(raw_request).abort_requests(request_ids)


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(
    raw_request: Request, init_info: Annotated[dict[str, Any], Body(embed=True)]
) -> dict[str, Any]:
    return await rl(raw_request).init_weight_transfer_engine(init_info)


@router.post("/shutdown_weight_transfer_engine")
async def shutdown_weight_transfer_engine(raw_request: Request) -> dict[str, Any]:
    return await rl(raw_request).shutdown_weight_transfer_engine()


@router.post("/start_weight_update")
async def start_weight_update(raw_request: Request) -> dict[str, Any]:
    return await rl(raw_request).start_weight_update()


@router.post("/update_weights")
async def update_weights(
    raw_request: Request, update_info: Annotated[dict[str, Any], Body(embed=True)]
) -> dict[str, Any]:
    return await rl(raw_request).update_weights(update_info)


@router.post("/finish_weight_update")
async def finish_weight_update(
    raw_request: Request,
    weight_version: Annotated[str | None, Body(embed=True, max_length=128)] = None,
) -> dict[str, Any]:
    """End a weight update: ``weight_version`` labels the new weights before generation resumes,
    and no later request reuses a prefix the old weights cached."""
    return await rl(raw_request).finish_weight_update(weight_version)


@router.post("/update_weight_version")
async def update_weight_version(
    raw_request: Request,
    new_version: Annotated[str, Body(embed=True, min_length=1, max_length=128)],
) -> dict[str, Any]:
    return await rl(raw_request).update_weight_version(new_version)


@router.get("/weight_info")
async def weight_info(raw_request: Request) -> dict[str, Any]:
    return await rl(raw_request).weight_info()


@router.get("/weight_update")
async def weight_update(raw_request: Request) -> dict[str, Any]:
    """routereplay: the RL call that runs now (``running``: op, arguments, ``started_at``) and
    the last weight change (``last_weight_change``: a reload or a finished transfer, its
    ``state`` ``done`` or ``failed`` and ``error``), for a caller whose call timed out."""
    return await rl(raw_request).weight_update()


@router.post("/reload_weights")
async def reload_weights(
    raw_request: Request,
    weights_path: Annotated[str, Body(embed=True, min_length=1)],
    weight_version: Annotated[str | None, Body(embed=True, min_length=1, max_length=128)] = None,
) -> dict[str, Any]:
    """routereplay: load the weights of a checkpoint directory in place (safetensors as the
    model's own) and label them ``weight_version``, both before generation resumes; no later
    request reuses a prefix the old weights cached."""
    return await rl(raw_request).reload_weights(weights_path, weight_version)


@router.get("/get_world_size")
async def get_world_size(
    raw_request: Request, include_dp: Annotated[bool, Query()] = True
) -> dict[str, Any]:
    return await rl(raw_request).world_size(include_dp)
