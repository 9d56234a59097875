"""HTTP routers, one module per concern; each handler is a few lines that call a serving class.

- ``completions``: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /invocations``
  -> ``serving.completions`` (ServingChat, ServingCompletion)
- ``models``: ``GET /v1/models[/{id}]``, ``POST /tokenize``, ``POST /detokenize``
  -> ``serving.models`` (ServingModels)
- ``routes``: ``GET``/``DELETE /v1/routes/{id}``, ``POST /v1/routes:batch``
  -> ``serving.routes`` (ServingRoutes)
- ``probes``: ``GET /health``, ``/ping``, ``GET /ready``, ``GET /version``, ``GET /metrics``
- ``rl``: vLLM's RL control API (admin keys) -> ``serving.rl`` (ServingRL)
- ``docs``: ``GET /openapi.json``, ``GET /docs`` (Swagger UI), behind the API keys
"""

from . import completions, docs, models, probes, rl, routes

ROUTERS = [
    completions.router,
    models.router,
    routes.router,
    probes.router,
    rl.router,
    docs.router,
]

__all__ = ["ROUTERS"]
