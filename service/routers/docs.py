"""The API's own description: ``GET /openapi.json`` and the Swagger UI at ``GET /docs``.

Both sit behind the API keys like every endpoint but ``/health`` (the app factory turns FastAPI's
unauthenticated defaults off), and neither is listed in the schema it serves.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from ..auth import principal

router = APIRouter(include_in_schema=False, dependencies=[Depends(principal)])


@router.get("/openapi.json")
async def openapi(raw_request: Request) -> JSONResponse:
    """The OpenAPI document of the app serving this request (built once, then cached by FastAPI)."""
    return JSONResponse(raw_request.app.openapi())


@router.get("/docs")
async def docs() -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title="routereplay")
