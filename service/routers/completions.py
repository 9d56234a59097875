"""``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI-compatible), and
``POST /invocations`` (either, by the body's shape)."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from ..auth import Caller
from ..errors import error_responses
from ..http_limits import JSONRoute
from ..protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from ..request_ids import REQUEST_ID_PATTERN
from ..state import service_state

router = APIRouter(tags=["OpenAI"], route_class=JSONRoute)

RequestIdHeader = Annotated[
    str | None,
    Header(
        alias="X-Request-Id",
        description=f"`{REQUEST_ID_PATTERN}`; the response id, and route ids are "
        "`<id>-<choice>`. Generated when absent; 409 while another request with it is in flight.",
    ),
]
_ERRORS = error_responses(400, 401, 404, 409, 413, 503)
_SSE = {"text/event-stream": {"schema": {"type": "string"}}}


@router.post(
    "/v1/chat/completions",
    responses={200: {"model": ChatCompletionResponse, "content": _SSE}, **_ERRORS},
    response_class=Response,
)
async def create_chat_completion(
    request: ChatCompletionRequest,
    raw_request: Request,
    who: Caller,
    x_request_id: RequestIdHeader = None,
) -> Response:
    """A chat completion; each choice's routed experts stored, a handle in its place."""
    st = service_state(raw_request)
    return await st.chat.create(request, raw_request, x_request_id, st.store_for(who.tenant))


@router.post(
    "/v1/completions",
    responses={200: {"model": CompletionResponse, "content": _SSE}, **_ERRORS},
    response_class=Response,
)
async def create_completion(
    request: CompletionRequest,
    raw_request: Request,
    who: Caller,
    x_request_id: RequestIdHeader = None,
) -> Response:
    """A text completion; each choice's routed experts stored, a handle in its place."""
    st = service_state(raw_request)
    return await st.completion.create(request, raw_request, x_request_id, st.store_for(who.tenant))


@router.post(
    "/invocations",
    responses={200: {"content": _SSE}, **_ERRORS},
    response_class=Response,
)
async def invocations(
    raw_request: Request, who: Caller, x_request_id: RequestIdHeader = None
) -> Response:
    """SageMaker's inference route, as vLLM serves it: a body with ``messages`` is a chat
    completion, any other a text completion; each choice's routes stored as there."""
    try:
        body = await raw_request.json()
    except json.JSONDecodeError as e:
        error = {"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error"}
        raise RequestValidationError([{**error, "ctx": {"error": e.msg}}]) from None
    chat = isinstance(body, dict) and "messages" in body
    kind = ChatCompletionRequest if chat else CompletionRequest
    try:
        request = kind.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        ) from None
    st = service_state(raw_request)
    serving = st.chat if chat else st.completion
    return await serving.create(request, raw_request, x_request_id, st.store_for(who.tenant))
