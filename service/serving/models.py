"""Serving what the engine knows without generating: the model list and (de)tokenization."""

from __future__ import annotations

import time

from ..engine import EngineBackend
from ..errors import NotFoundError
from ..protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    RoutedExpertsLayout,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

__all__ = ["ServingModels"]


class ServingModels:
    """``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize``."""

    def __init__(self, backend: EngineBackend) -> None:
        self.backend = backend
        self.created = int(time.time())

    def card(self) -> ModelCard:
        info = self.backend.info
        return ModelCard(
            id=info.name,
            created=self.created,
            # vLLM's own clients (`vllm bench serve`) take the tokenizer from `root`.
            root=info.root or info.name,
            max_model_len=info.max_model_len,
            routed_experts=RoutedExpertsLayout(
                num_layers=info.num_layers,
                moe_layers=list(info.moe_layers),
                num_experts=info.num_experts,
                top_k=info.top_k,
            ),
        )

    def list(self) -> ModelList:
        return ModelList(data=[self.card()])

    def get(self, model_id: str) -> ModelCard:
        self._check_model(model_id)
        return self.card()

    def _check_model(self, model: str | None) -> None:
        name = self.backend.info.name
        if model is not None and model != name:
            raise NotFoundError(
                f"model {model!r} does not exist; this server serves {name!r}",
                param="model",
                code="model_not_found",
            )

    async def tokenize(
        self, req: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        self._check_model(req.model)
        return await self.backend.tokenize(req)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(req.model)
        return DetokenizeResponse(prompt=await self.backend.detokenize(req))
