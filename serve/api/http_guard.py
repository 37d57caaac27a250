"""The service's outer layer: what stands between a socket and the app.

- ``GuardMiddleware`` (pure ASGI, no per-request thread hop): request ids, structured JSON logs,
  bearer auth (constant-time compare), the body cap and body timeout (the body is read here, in
  full, before the app sees it, so an oversized chunked body is a 413 on every route and a client
  that stalls mid-body is answered 408 instead of holding a worker and delaying shutdown), and the
  mapping of errors to status codes, so the process survives every bad request and clients never
  see internals. Every error has one shape: ``{"error": "<message naming the value and the allowed range>"}``.
  A ``shortcut`` (the KServe infer route) runs in place of the app for the requests it claims, with all of
  the above around it.
- ``guarded_protocol``: uvicorn's h11 connection, plus what uvicorn lacks: a deadline for a
  request's headers (a connection that never sends a byte, or trickles its headers, is closed
  after ``header_timeout_s``, also between keep-alive requests) and a connection limit that sheds
  the oldest idle connection first; only when every connection is busy does a new one get a 503
  with Retry-After and our JSON body.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ldlm.serve.api.errors import HTTPError, error_body, error_status
from ldlm.serve.api.kserve_models import metrics_label
from ldlm.serve.api.openai_schemas import MODEL_ID
from ldlm.serve.api.service import LDLMService
from ldlm.serve.runtime.cost import DeadlineUnreachableError, RequestTooLargeError
from ldlm.serve.runtime.tracing import CURRENT, RequestTrace, Tracing

log = logging.getLogger("ldlm.serve")
CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection before the answer": logs and metrics only


class GuardMiddleware:
    # Open without the key: the health probes, /version (as vLLM's server guards only /v1: a load
    # balancer or client reads the version before it is given a key), and what a browser needs to show
    # the playground and /docs (the page, Swagger UI's assets, the schema /docs renders). Every route
    # that runs the model or tells about it (/v1, /v2 infer and metadata, /metrics) needs the key; the
    # playground sends the one typed into it. Kubernetes manifests written for vLLM probe /health.
    OPEN_PATHS = frozenset({"/", "/docs", "/openapi.json", "/health", "/version"})
    OPEN_PREFIXES = ("/v2/health/", "/static/swagger/")

    @classmethod
    def is_open(cls, path: str) -> bool:
        return path in cls.OPEN_PATHS or path.startswith(cls.OPEN_PREFIXES)

    def __init__(
        self,
        app: Any,
        service: LDLMService,
        shortcut: Callable[[dict[str, Any]], Any] | None = None,
        routes: Sequence[Any] = (),
        tracing: Tracing | None = None,
    ) -> None:
        """``routes``: the app's routes (each with a ``path``): the /v1 routes among them are what requests to /v1
        are counted under, and traced under while ``tracing`` is on (None: off)."""
        self.app, self.service, self.shortcut, self.tracing = app, service, shortcut, tracing
        key = service.settings.api_key
        self.expected_auth = f"Bearer {key}".encode() if key else None
        self.v1_labels = frozenset(route.path.split("/")[2] for route in routes if route.path.startswith("/v1/"))

    def model_label(self, path: str) -> str | None:
        """The label ``path``'s request is counted under in /metrics: its model's for a /v2 infer (``metrics_label``),
        a /v1 route's name; None for any other path. Never a name only the request has (``/v2/models/x1/infer``,
        ``/v1/x1``): the label set, and the memory /metrics takes, stay bounded whatever clients send."""
        name = _model_of(path)
        if name is None or not path.startswith("/v2/"):
            return name if name in self.v1_labels else None
        return metrics_label(self.service, name)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        settings = self.service.settings
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        started = time.perf_counter()
        status = {"code": 500}
        model = self.model_label(scope["path"])
        trace = self._trace(scope, headers, request_id) if model is not None and self.tracing is not None else None

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                status["complete"] = True
                if trace is not None:
                    trace.delivered = time.perf_counter()
            await send(message)

        try:
            if self.expected_auth is not None and not self.is_open(scope["path"]):
                given = headers.get("authorization", "").encode("latin-1")
                if not hmac.compare_digest(given, self.expected_auth):  # no timing hint about the key
                    return await _reply(send_wrapper, 401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"}, scope["path"])
            body = await read_body(receive, headers.get("content-length"), settings.max_body_bytes, settings.body_timeout_s)
            app = (self.shortcut(scope) if self.shortcut is not None else None) or self.app
            await self._run_until_disconnect(app, scope, body, receive, send_wrapper, status)
        except Exception as error:
            code, message, extra = error_status(error)
            if isinstance(error, (DeadlineUnreachableError, RequestTooLargeError)):
                reason = "deadline" if isinstance(error, DeadlineUnreachableError) else "too_large"
                self.service.metrics.request_refused.labels(model or "", reason).inc()
            if code == 500:  # the process survives; the client learns nothing internal
                log.exception("unhandled error", extra={"request_id": request_id})
                message = f"internal error ({type(error).__name__}); request id {request_id}"
            await _reply(send_wrapper, code, message, extra, scope["path"], getattr(error, "param", None))
        finally:
            elapsed = time.perf_counter() - started
            disconnected = bool(status.get("disconnected"))
            code = status["code"] = CLIENT_CLOSED if disconnected else status["code"]
            if model is not None:
                self.service.metrics.count_request(model, code, elapsed, disconnected)
            if trace is not None:
                trace.attributes["http.response.status_code"] = code
                trace.end(code)
            log.info(
                "request",
                extra={
                    "request_id": request_id,
                    "method": scope["method"],
                    "path": scope["path"],
                    "status": code,
                    "ms": round(1000 * elapsed, 3),
                },
            )

    def _trace(self, scope: dict[str, Any], headers: dict[str, str], request_id: str) -> RequestTrace:
        """A traced request's trace, made the current one of the task that serves it (``tracing.CURRENT``)."""
        path = scope["path"]
        model = _model_of(path) if path.startswith("/v2/") else MODEL_ID
        trace = self.tracing.http_request(scope["method"], http_route(path), headers, request_id, model)  # type: ignore[union-attr, arg-type]
        CURRENT.set(trace)  # the guard's own task: the app's task, made after this, inherits it
        return trace

    async def _run_until_disconnect(
        self, app: Any, scope: dict[str, Any], body: bytes | bytearray, receive: Any, send: Any, status: dict[str, Any]
    ) -> None:
        """Run ``app`` (the app, or a shortcut) with ``body`` replayed; if the client disconnects before the answer is complete,
        cancel the app's task. Starlette does not do this for plain (non-streamed) responses: a handler
        would wait for its generation to the end, holding scheduler slots and batcher rows for nobody.
        Cancelling the task cancels the future it awaits (``offload.wait``), and a cancelled future leaves
        the scheduler's batch at its next step and the dynamic batcher's queue before it runs."""
        replayed = False
        disconnected = asyncio.Event()

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()  # the body is all read: only http.disconnect remains
            return {"type": "http.disconnect"}

        async def watch() -> None:
            # uvicorn answers receive() with http.disconnect once the peer is gone (or the response is
            # complete, which is not a reason to cancel anything)
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()
            if not status.get("complete") and not task.done():
                status["disconnected"] = True
                task.cancel()

        task = asyncio.ensure_future(app(scope, replay, send))
        watcher = asyncio.ensure_future(watch())
        try:
            await task
        except asyncio.CancelledError:
            if not status.get("disconnected"):
                raise  # the server itself is being cancelled (shutdown): not ours to swallow
        finally:
            watcher.cancel()
            task.cancel()  # when the middleware's own task is cancelled, the app's goes with it


async def read_body(receive: Any, content_length: str | None, limit: int, timeout_s: float) -> bytes | bytearray:
    """The whole request body, at most ``limit`` bytes (413) within ``timeout_s`` (408)."""
    if content_length is not None and (not content_length.isdigit() or int(content_length) > limit):
        raise HTTPError(413, f"body of {content_length} bytes exceeds the limit of {limit} bytes (--max-body-mb)")
    parts, received = [], 0
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            raise HTTPError(408, f"the request body did not arrive within {timeout_s:g} s", {"Connection": "close"}) from None
        if message["type"] == "http.disconnect":
            raise HTTPError(400, "the client disconnected before sending the whole body")
        chunk = message.get("body", b"")
        received += len(chunk)
        if received > limit:  # chunked bodies have no Content-Length to refuse up front
            raise HTTPError(413, f"body exceeds the limit of {limit} bytes (--max-body-mb)", {"Connection": "close"})
        parts.append(chunk)
        if not message.get("more_body", False):
            # one chunk as it came; several joined into a bytearray (the one copy a join makes anyway), whose
            # binary tensors are then writable views that reach the graph uncopied
            return parts[0] if len(parts) == 1 else bytearray().join(parts)


def http_route(path: str) -> str:
    """The route of a counted path (``model_label``'s): a /v1 route's path is its own; a /v2 infer path's names its model."""
    if not path.startswith("/v2/"):
        return path
    return "/v2/models/{model}/versions/{version}/infer" if "/versions/" in path else "/v2/models/{model}/infer"


def _model_of(path: str) -> str | None:
    if path.startswith("/v2/models/") and path.endswith("/infer"):
        return path.split("/")[3]
    if path.startswith("/v1/"):
        return path.split("/")[2]
    return None


async def _reply(
    send: Any, status: int, message: str, headers: dict[str, str] | None = None, path: str = "", param: str | None = None
) -> None:
    body = error_body(message, status, path, param)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    try:
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})
    except RuntimeError:
        pass  # the response had already started; nothing more can be said


def raw_response(status: int, reason: str, message: str, extra: str = "") -> bytes:
    """A complete HTTP/1.1 error response, for the protocol layer (no app, no h11 state)."""
    body = error_body(message)
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n{extra}connection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 connection with a header deadline and idle-first connection shedding; its two limits
    are set per server by ``guarded_protocol``."""

    header_timeout_s: float
    max_connections: int

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override, unused-ignore]  # uvicorn's signature varies by release
        super().connection_made(transport)
        self.opened_at = time.monotonic()
        self.header_timer: asyncio.TimerHandle | None = None
        self.awaited_cycle = self.cycle
        self._arm_header_deadline()
        if len(self.connections) > self.max_connections and self._open_connections() > self.max_connections and not self._shed_idle():
            message = f"the server holds {self.max_connections} busy connections (its limit); retry shortly"
            transport.write(raw_response(503, "Service Unavailable", message, "retry-after: 1\r\n"))
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and self.cycle is not self.awaited_cycle:
            self._disarm()  # the headers of a new request are in; the body has its own timeout

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.awaited_cycle = self.cycle
            self._arm_header_deadline()  # the next request's headers get the same deadline

    def shutdown(self) -> None:
        if not self.is_idle() and self.conn.their_state is h11.SEND_BODY:
            self.transport.close()  # a body still arriving at shutdown will not be served: free its task now
            return
        super().shutdown()

    def is_idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_deadline(self) -> None:
        self._disarm()
        self.header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _disarm(self) -> None:
        if getattr(self, "header_timer", None) is not None:
            self.header_timer.cancel()  # type: ignore[union-attr]
            self.header_timer = None

    def _header_timeout(self) -> None:
        self.header_timer = None
        if self.is_idle() and not self.transport.is_closing():  # headers incomplete: a slow or idle client
            if self.conn.trailing_data[0]:  # part of a request came: say why it ends
                message = f"the request headers did not arrive within {self.header_timeout_s:g} s"
                self.transport.write(raw_response(408, "Request Timeout", message))
            self.transport.close()

    def _open_connections(self) -> int:
        return sum(not c.transport.is_closing() for c in self.connections)  # closed ones leave the set a loop turn later

    def _shed_idle(self) -> bool:
        idle = [c for c in self.connections if c is not self and isinstance(c, type(self)) and c.is_idle() and not c.transport.is_closing()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.opened_at)
        oldest.transport.close()
        return True


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with a header deadline and idle-first connection shedding."""
    # a class per server, its limits as class attributes: uvicorn makes each connection from the class alone
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": header_timeout_s, "max_connections": max_connections})


class JsonLogFormatter(logging.Formatter):
    FIELDS = ("request_id", "method", "path", "status", "ms")

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname, "msg": record.getMessage()}
        entry.update({k: getattr(record, k) for k in self.FIELDS if hasattr(record, k)})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)
