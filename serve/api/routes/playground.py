"""The playground page at ``/`` and the ``/docs`` Swagger UI, every asset served from this process.

No CDN: the page is one static HTML file with inline script and style (serve/api/routes/static/), and Swagger
UI's JavaScript and CSS (Swagger UI 5, which reads the OpenAPI 3.1 that FastAPI writes) come from the
``fastapi-offline`` package, so both work offline.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, Response

from ldlm.serve.api.errors import HTTPError

STATIC = Path(__file__).parent / "static"
SWAGGER_FILES = ("swagger-ui-bundle.js", "swagger-ui.css")


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
    async def playground() -> Response:
        return FileResponse(STATIC / "playground.html", media_type="text/html; charset=utf-8")

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
