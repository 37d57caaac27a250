"""The inference server: the FastAPI app assembled from its routers, bound to a socket, shut down gracefully.

  GET  /v2, /v2/health/live, /v2/health/ready      KServe v2 (routes.kserve), one model per graph
  GET  /v2/models/{model}[/versions/{v}], .../ready
  POST /v2/models/{model}[/versions/{v}]/infer     JSON and binary tensors (tritonclient works as is)
  POST /v1/generate, /v1/reconstruct, /v1/encode   text in, text / ids / latents out (routes.text)
  GET  /v1/models, POST /v1/completions            OpenAI-compatible (routes.openai)
  GET  /health, /version                           vLLM's additions to that API (routes.openai)
  POST /v1/tokenize, /v1/detokenize
  GET  /, /docs, /openapi.json                     the playground and OpenAPI (routes.playground)
  GET  /metrics                                    Prometheus (routes.metrics)

Graph requests go through one DynamicBatcher per graph; generation goes through the step-level
continuous-batching scheduler (both held by ``service.LDLMService``). Queues are bounded (503 with
Retry-After when full), every request has a timeout (504), bodies are capped (413), samples and
tokens per request are capped (413), large requests run in ``max_batch`` chunks, JSON is decoded and
encoded off the event loop (offload), slow and idle connections are timed out (http_guard), and
nothing from a request is ever executed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator, Iterator

import uvicorn
from fastapi import FastAPI

from ldlm import __version__
from ldlm.interrupts import raise_if_interrupted
from ldlm.serve.api.errors import add_error_handlers
from ldlm.serve.api.http_guard import GuardMiddleware, JsonLogFormatter, guarded_protocol
from ldlm.serve.api.routes import kserve, metrics, openai, playground, text
from ldlm.serve.api.schemas import ERROR_RESPONSES
from ldlm.serve.api.service import LDLMService, ServerSettings

log = logging.getLogger("ldlm.serve")


def create_app(service: LDLMService) -> FastAPI:
    """The app of one service: the guard around every route, the one error shape, and the routers."""
    settings = service.settings
    text_models = text.text_request_models(service)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.get_running_loop().run_in_executor(None, service.close)  # drain, then stop
        log.info("shutdown complete")

    app = FastAPI(
        title="ldlm",
        version=__version__,
        lifespan=lifespan,
        responses=ERROR_RESPONSES,
        docs_url=None,
        redoc_url=None,
        description="LDLM inference: KServe v2 for the encoder, denoiser and decoder graphs, and a text API. "
        f"Limits of this server: {settings.max_body_bytes} body bytes; {settings.max_request_samples} samples and "
        f"{settings.max_request_tokens} tokens (batch x seq) per /v2 infer request; n, length, steps and texts "
        "as in the request schemas.",
    )
    app.state.service = service
    routers = [
        kserve.create_router(service),
        text.create_router(service, text_models),
        openai.create_router(service),
        playground.create_router(),
        metrics.create_router(service),
    ]
    routes = [route for router in routers for route in router.routes]  # each an APIRoute, with its path
    app.add_middleware(GuardMiddleware, service=service, shortcut=kserve.infer_shortcut(service), routes=routes, tracing=service.tracing)
    add_error_handlers(app, text_models.limits)
    for router in routers:
        app.include_router(router)
    return app


class PortInUseError(RuntimeError):
    """The port is taken; the message names it and how to choose another."""


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before anything is loaded or printed, so a busy port fails at once and cleanly."""
    # IPPROTO_TCP named, not 0: asyncio turns Nagle off (TCP_NODELAY) only on connections whose socket
    # says TCP, and with Nagle on, a response's body waits behind its headers for the client's delayed
    # ACK, about 40 ms on Linux's loopback.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"port {port} on {host} is already in use (another `ldlm serve`?); choose another with "
                f"--port, e.g. --port {port + 1 if port < 65535 else 8000}, or stop the process that holds it"
            ) from None
        raise RuntimeError(f"cannot bind {host}:{port}: {error.strerror}; choose another --host or --port") from None
    sock.set_inheritable(True)
    return sock


def server_config(app: FastAPI, settings: ServerSettings) -> uvicorn.Config:
    """uvicorn with our connection layer: header deadline, idle-first shedding, keep-alive and body timeouts."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        http=guarded_protocol(settings.header_timeout_s, settings.max_connections),
        timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type, unused-ignore]  # uvicorn annotates int; its timer takes any seconds
        timeout_graceful_shutdown=int(settings.request_timeout_s) + 5,
        backlog=2048,
    )


@contextlib.contextmanager
def json_log(level: str) -> Iterator[None]:
    """The service's log as JSON lines on stderr at ``level`` within the block, and the logger as it was
    after it: serve() may be called from Python, and the stderr it started with may be closed by then."""
    handlers, previous_level, propagate = log.handlers[:], log.level, log.propagate
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter())
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False
    try:
        yield
    finally:
        log.handlers[:] = handlers
        log.setLevel(previous_level)
        log.propagate = propagate


def serve(source: str, settings: ServerSettings, log_level: str = "info") -> None:
    """Bind (127.0.0.1 by default), load, serve until SIGINT/SIGTERM, then drain and exit."""
    with json_log(log_level):
        _serve(source, settings)


def _serve(source: str, settings: ServerSettings) -> None:
    sock = bind_socket(settings.host, settings.port)
    try:
        service = LDLMService(source, settings, progress=lambda line: print(f"ldlm serve: {line}", file=sys.stderr, flush=True))
        raise_if_interrupted()  # Ctrl-C while preparing, dropped by Python where it landed: do not start serving
        app = create_app(service)
        port = sock.getsockname()[1]
        url = f"http://{settings.host}:{port}"
        auth = ' -H "Authorization: Bearer $LDLM_API_KEY"' if settings.api_key else ""  # the key itself is never printed
        providers = ", ".join(f"{g}: {b.provider} [{b.precision}]" for g, b in service.graphs.items())
        print(f"ldlm serving {source} ({settings.backend}; {providers}) on {url}", flush=True)
        print(
            f"try: curl -s {url}/v1/generate -H 'Content-Type: application/json'{auth} "
            f'-d \'{{"n": 2, "length": 32}}\'',  # the server picks steps, sampler and grid itself
            flush=True,
        )
        print(f"docs: {url}/docs   metrics: {url}/metrics", flush=True)
        server = GracefulServer(server_config(app, settings))
        server.run(sockets=[sock])
        if not server.started:  # the app's start-up failed (uvicorn logged why): not a clean exit
            raise RuntimeError("the server did not start; see the log above")
    finally:
        sock.close()


class GracefulServer(uvicorn.Server):
    """uvicorn's Server, but SIGINT/SIGTERM end in a drained exit with status 0 (uvicorn re-raises
    the signal after shutting down, which reports a clean shutdown as a kill)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
