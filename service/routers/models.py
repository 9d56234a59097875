"""``/v1/models`` (OpenAI and vLLM fields) and vLLM's ``/tokenize`` and ``/detokenize``."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request
from pydantic import Discriminator, Tag

from ..auth import principal
from ..errors import error_responses
from ..http_limits import JSONRoute
from ..protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from ..state import service_state

router = APIRouter(
    tags=["Models and tokenization"], route_class=JSONRoute, dependencies=[Depends(principal)]
)


def _tokenize_kind(v: Any) -> str:
    return "Chat" if isinstance(v, dict) and "messages" in v else "Prompt"


# vLLM's TokenizeRequest: a prompt, or chat messages rendered with the chat template.
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("Prompt")]
    | Annotated[TokenizeChatRequest, Tag("Chat")],
    Discriminator(_tokenize_kind),
]


@router.get("/v1/models", response_model=ModelList)
async def list_models(raw_request: Request) -> ModelList:
    """The served model, with its route layout (`routed_experts`)."""
    return service_state(raw_request).models.list()


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(404))
async def retrieve_model(model_id: str, raw_request: Request) -> ModelCard:
    return service_state(raw_request).models.get(model_id)


@router.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(400, 404))
async def tokenize(
    request: Annotated[TokenizeRequest, Body()], raw_request: Request
) -> TokenizeResponse:
    """Token ids of a prompt, or of chat messages as the engine renders them."""
    return await service_state(raw_request).models.tokenize(request)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=error_responses(400, 404))
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> DetokenizeResponse:
    return await service_state(raw_request).models.detokenize(request)
