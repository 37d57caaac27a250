"""Guards of the server's settings and helpers that no other test triggers, each with the message a
user sees: ServerSettings at its edges, an address that is not ours, a JSON worker that dies
mid-request, a generation stream that times out, and the playground's fixed list of assets."""

from __future__ import annotations

import asyncio
import json
import re
import time
import types
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

import pytest


def raises(error: type[Exception], message: str):
    return pytest.raises(error, match=re.escape(message))


# --- the server's settings and helpers ----------------------------------------------------------------


def test_server_settings_edges() -> None:
    from ldlm.serve.api.service import ServerSettings

    for name in ("request_timeout_s", "header_timeout_s", "body_timeout_s", "keep_alive_s"):
        assert getattr(ServerSettings(**{name: 0.001}), name) == 0.001
        for bad in (0, -1):
            with raises(ValueError, f"{name}={bad} is out of range; allowed: a number in (0, 86400]"):
                ServerSettings(**{name: bad})
    assert ServerSettings(preview_budget=1.0).preview_budget == 1.0
    for bad in (0, 1.5):
        with raises(ValueError, f"preview_budget={bad} is out of range; allowed: a number in (0, 1]"):
            ServerSettings(preview_budget=bad)
    assert ServerSettings(max_delay_ms=0).max_delay_ms == 0
    with raises(ValueError, "max_delay_ms=-0.5 is out of range; allowed: a number in [0, 60000]"):
        ServerSettings(max_delay_ms=-0.5)
    for name, low, high in (("port", 0, 65535), ("max_body_bytes", 1024, 1 << 31), ("max_n", 1, 1 << 16)):
        assert getattr(ServerSettings(**{name: low}), name) == low and getattr(ServerSettings(**{name: high}), name) == high
        for bad in (low - 1, high + 1):
            with raises(ValueError, f"{name}={bad} is out of range; allowed: {low}..{high}"):
                ServerSettings(**{name: bad})


def test_an_address_that_is_not_ours_is_named() -> None:
    from ldlm.serve.api.server import bind_socket

    with pytest.raises(RuntimeError, match=r"cannot bind 192\.0\.2\.1:8000: .+; choose another --host or --port"):
        bind_socket("192.0.2.1", 8000)  # TEST-NET-1: no interface of this machine has it


def test_a_json_worker_that_dies_mid_request_is_a_503() -> None:
    from ldlm.serve.api.errors import HTTPError
    from ldlm.serve.api.offload import run_json
    from ldlm.serve.api.service import ServerSettings

    def broken(fn, *args) -> Future:
        future: Future = Future()
        future.set_exception(BrokenProcessPool("a worker died"))
        return future

    service = types.SimpleNamespace(settings=ServerSettings(), submit_json=broken)
    with pytest.raises(HTTPError) as error:
        asyncio.run(run_json(service, True, json.dumps, {}))  # type: ignore[arg-type]
    assert (error.value.status, error.value.message, error.value.headers) == (
        503,
        "a JSON worker process died during this request; retry",
        {"Retry-After": "1"},
    )
    assert asyncio.run(run_json(service, False, json.dumps, {"a": 1})) == '{"a": 1}'  # type: ignore[arg-type]  # light: a thread


def test_a_generation_stream_times_out_and_cancels_its_request() -> None:
    from ldlm.serve.api.streaming import GenerationStream
    from ldlm.serve.runtime.scheduler import GenerateRequest

    class NeverDone:
        """A scheduler (or its submit) whose request never finishes."""

        def __init__(self) -> None:
            self.futures: list[Future] = []

        def submit(self, spec, prefix=None, hook=None, every=0) -> Future:
            self.futures.append(Future())
            return self.futures[-1]

        __call__ = submit

    async def run(scheduler: NeverDone) -> None:
        stream = GenerationStream(scheduler, None, GenerateRequest(1, 4, 1), loop=asyncio.get_running_loop())  # type: ignore[arg-type]
        async for _ in stream.events(0.05):
            pass

    scheduler = NeverDone()
    started = time.monotonic()
    with raises(TimeoutError, "request timed out after 0.05 s"):
        asyncio.run(run(scheduler))
    assert time.monotonic() - started < 5 and scheduler.futures[0].cancelled()


def test_playground_assets_are_a_fixed_list(monkeypatch) -> None:
    httpx = pytest.importorskip("httpx")
    from fastapi import FastAPI, Request
    from fastapi.responses import Response

    from ldlm.serve.api.errors import HTTPError
    from ldlm.serve.api.routes import playground

    def app_with(router) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None)  # as the server's: /docs is the playground router's
        app.include_router(router)

        @app.exception_handler(HTTPError)
        async def handle(request: Request, error: HTTPError) -> Response:
            return Response(json.dumps({"error": error.message}), error.status, media_type="application/json")

        return app

    async def get(app: FastAPI, path: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get(path)

    app = app_with(playground.create_router())
    for name in ("../../etc/passwd", "swagger-ui.js.map", "evil.js"):
        response = asyncio.run(get(app, f"/static/swagger/{name}"))
        assert response.status_code == 404, name
    evil = asyncio.run(get(app, "/static/swagger/evil.js")).json()["error"]
    assert evil.startswith("no asset 'evil.js'; available: ") and all(f in evil for f in playground.SWAGGER_FILES)
    monkeypatch.setattr(playground, "swagger_dir", lambda: None)  # fastapi-offline not installed
    bare = app_with(playground.create_router())
    docs = asyncio.run(get(bare, "/docs"))
    assert docs.status_code == 404 and docs.json() == {
        "error": "Swagger UI's assets are not installed (pip install fastapi-offline); the schema is at /openapi.json"
    }
    assert asyncio.run(get(bare, f"/static/swagger/{playground.SWAGGER_FILES[0]}")).status_code == 404
