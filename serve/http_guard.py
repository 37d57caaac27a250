"""The service's outer layer, in pure ASGI (no per-request thread hop): request ids, structured
JSON logs, the body cap, bearer auth, and the mapping of errors to status codes, so the process
survives every bad request and clients never see internals."""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from ldlm.serve.backends import BackendError
from ldlm.serve.kserve import ProtocolError
from ldlm.serve.scheduler import QueueFullError

if TYPE_CHECKING:
    from ldlm.serve.server import LDLMService

log = logging.getLogger("ldlm.serve")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


class GuardMiddleware:
    """Pure ASGI (no per-request thread hop): request ids, structured logs, body cap, bearer auth,
    and the mapping of errors to status codes, so the process survives every bad request."""

    OPEN_PATHS = ("/v2/health/",)

    def __init__(self, app: Any, service: "LDLMService") -> None:
        self.app, self.service = app, service

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        settings = self.service.settings
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        started = time.perf_counter()
        status = {"code": 500}
        model = _model_of(scope["path"])

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message.setdefault("headers", []).append((b"x-request-id", request_id.encode()))
            await send(message)

        try:
            if settings.api_key and not scope["path"].startswith(self.OPEN_PATHS):
                if headers.get("authorization") != f"Bearer {settings.api_key}":
                    return await _reply(send_wrapper, 401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > settings.max_body_bytes):
                return await _reply(send_wrapper, 413, f"body of {length} bytes exceeds the limit of {settings.max_body_bytes}")
            received = 0

            async def capped_receive() -> dict[str, Any]:
                nonlocal received
                message = await receive()
                received += len(message.get("body", b""))
                if received > settings.max_body_bytes:
                    raise HTTPError(413, f"body exceeds the limit of {settings.max_body_bytes} bytes")
                return message

            await self.app(scope, capped_receive, send_wrapper)
        except HTTPError as error:
            await _reply(send_wrapper, error.status, error.message, error.headers)
        except QueueFullError as error:
            await _reply(send_wrapper, 503, str(error), {"Retry-After": "1"})
        except (ProtocolError, BackendError, ValueError) as error:
            await _reply(send_wrapper, 400, str(error))
        except Exception as error:  # the process survives; the client learns nothing internal
            log.exception("unhandled error", extra={"request_id": request_id})
            await _reply(send_wrapper, 500, f"internal error ({type(error).__name__}); request id {request_id}")
        finally:
            elapsed = time.perf_counter() - started
            code = status["code"]
            if model is not None:
                if code < 400:
                    self.service.metrics.request_success.labels(model).inc()
                else:
                    self.service.metrics.request_failure.labels(model, str(code)).inc()
                self.service.metrics.request_seconds.labels(model).observe(elapsed)
            log.info("request", extra={"request_id": request_id, "method": scope["method"], "path": scope["path"],
                                       "status": code, "ms": round(1000 * elapsed, 3)})


def _model_of(path: str) -> str | None:
    if path.startswith("/v2/models/") and path.endswith("/infer"):
        return path.split("/")[3]
    if path.startswith("/v1/"):
        return path.split("/")[2]
    return None


async def _reply(send: Any, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"error": message}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    try:
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})
    except RuntimeError:
        pass  # the response had already started; nothing more can be said


class JsonLogFormatter(logging.Formatter):
    FIELDS = ("request_id", "method", "path", "status", "ms")

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname, "msg": record.getMessage()}
        entry.update({k: getattr(record, k) for k in self.FIELDS if hasattr(record, k)})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


