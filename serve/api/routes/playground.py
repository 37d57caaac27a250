"""The playground page at ``/`` and the ``/docs`` Swagger UI, every asset served from this process.

No CDN: the page is one HTML file with inline script and style (serve/api/routes/static/), and Swagger
UI's JavaScript and CSS (Swagger UI 5, which reads the OpenAPI 3.1 that FastAPI writes) come from the
``fastapi-offline`` package, so both work offline. The page carries this server's defaults (``server_defaults``):
what a request naming no sampler or steps gets, as ``ldlm.sampling.resolve`` plans it, which the page shows and
leaves to the server rather than sending numbers of its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, Response

from ldlm.model.config import SAMPLERS
from ldlm.sampling import GenerateRequest
from ldlm.serve.api.errors import HTTPError

STATIC = Path(__file__).parent / "static"
SWAGGER_FILES = ("swagger-ui-bundle.js", "swagger-ui.css")
DEFAULTS_SLOT = '<script id="server-defaults" type="application/json">null</script>'  # in playground.html


def server_defaults(service: Any) -> dict[str, Any]:
    """What this server runs for a request that names no steps: with no sampler (``default``), and per sampler
    (``samplers``), each ``{"sampler", "steps", "grid"}`` as the scheduler plans it (the checkpoint's tuned
    defaults included), or ``{"error"}`` where such a request is refused (a default above max_steps)."""

    def planned(sampler: str | None) -> dict[str, Any]:
        try:
            plan = service.scheduler.plan(GenerateRequest(1, 1, sampler=sampler))
        except ValueError as error:
            return {"error": str(error)}
        return {"sampler": plan.sampler.name, "steps": plan.steps, "grid": plan.grid}

    return {"default": planned(None), "samplers": {name: planned(name) for name in SAMPLERS}}


def page_with_defaults(defaults: dict[str, Any] | None) -> str:
    """playground.html with ``defaults`` in its JSON slot (``<`` escaped, so no value can close the script)."""
    page = (STATIC / "playground.html").read_text()
    return page.replace(DEFAULTS_SLOT, DEFAULTS_SLOT.replace("null", json.dumps(defaults).replace("<", "\\u003c")))


def swagger_dir() -> Path | None:
    try:
        import fastapi_offline  # optional: without its assets /docs answers 404 naming the package
    except ImportError:
        return None
    return Path(fastapi_offline.__file__).parent / "static"


def create_router() -> APIRouter:
    router = APIRouter(include_in_schema=False)
    swagger = swagger_dir()

    @router.get("/")
    async def playground(request: Request) -> Response:
        service = getattr(request.app.state, "service", None)  # the app's LDLMService (server.create_app)
        defaults = server_defaults(service) if service is not None else None
        return HTMLResponse(page_with_defaults(defaults), media_type="text/html; charset=utf-8")

    @router.get("/docs")
    async def docs() -> HTMLResponse:
        if swagger is None:
            raise HTTPError(404, "Swagger UI's assets are not installed (pip install fastapi-offline); the schema is at /openapi.json")
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="ldlm API",
            swagger_favicon_url="data:,",
            swagger_js_url="/static/swagger/swagger-ui-bundle.js",
            swagger_css_url="/static/swagger/swagger-ui.css",
        )

    @router.get("/static/swagger/{name}")
    async def swagger_asset(name: str) -> Response:
        if swagger is None or name not in SWAGGER_FILES:  # a fixed list: no path from a request reaches the disk
            raise HTTPError(404, f"no asset {name!r}; available: {', '.join(SWAGGER_FILES)}")
        media = "text/javascript" if name.endswith(".js") else "text/css"
        return FileResponse(swagger / name, media_type=media, headers={"Cache-Control": "max-age=86400"})

    return router
