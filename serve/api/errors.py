"""The one error shape of every route, and the app's handlers that give every error that shape.

A refused request gets ``{"error": "<message naming the value and the allowed range>"}``; on the
OpenAI routes it gets OpenAI's ``{"error": {"message", "type", "param", "code"}}``, which the
official client parses. This module sits below every other of the HTTP layer (the guard, the
routers): each of them raises ``HTTPError`` and none of them is imported here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ldlm.limits import Range
from ldlm.serve.api.kserve import ProtocolError, load_json
from ldlm.serve.api.schemas import field_name, validation_message
from ldlm.serve.runtime.cost import DeadlineUnreachableError, RequestTooLargeError
from ldlm.serve.runtime.queueing import QueueFullError

OPENAI_PATHS = ("/v1/completions", "/v1/models", "/v1/tokenize", "/v1/detokenize")
OPENAI_ROUTES = ("/v1/chat/", "/v1/embeddings", "/v1/engines", "/v1/edits", "/v1/moderations", "/v1/responses")  # what OpenAI clients call


class HTTPError(Exception):
    """An answer with ``status`` and one message; ``param`` names the request field at fault (OpenAI's error shape carries it)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers, self.param = status, message, headers or {}, param


# What a request can end with once its handler runs. The guard middleware answers each with
# ``error_status``; a stream whose status line is already sent reports the same in-band.
REQUEST_ERRORS = (HTTPError, TimeoutError, ValueError, RuntimeError)


def error_status(error: Exception) -> tuple[int, str, dict[str, str]]:
    """The one map from an error to (HTTP status, message, headers). 500 keeps the message for the log only."""
    if isinstance(error, HTTPError):
        return error.status, error.message, error.headers
    if isinstance(error, QueueFullError):
        return 503, str(error), {"Retry-After": "1"}
    if isinstance(error, DeadlineUnreachableError):  # the work ahead would make it late: when to come back
        return 503, str(error), {"Retry-After": str(math.ceil(error.retry_after_s))}
    if isinstance(error, RequestTooLargeError):  # late even alone
        return 413, str(error), {}
    if isinstance(error, TimeoutError):
        return 504, str(error), {}
    if isinstance(error, ValueError):  # ProtocolError, BackendError and the sampling engine's refusals
        return 400, str(error), {}
    return 500, str(error), {}


def openai_error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 503: "server_error", 504: "timeout"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def error_body(message: str, status: int = 400, path: str = "", param: str | None = None) -> bytes:
    """``{"error": message}``; on the OpenAI routes (and the OpenAI routes we do not serve), OpenAI's shape
    (its client parses that), with ``param``."""
    if path.startswith(OPENAI_PATHS + OPENAI_ROUTES):
        return json.dumps(openai_error(status, message, param)).encode()
    return json.dumps({"error": message}).encode()


def error_response(
    request: Request, status: int, message: str, headers: Mapping[str, str] | None = None, param: str | None = None
) -> Response:
    return Response(error_body(message, status, request.url.path, param), status, headers, "application/json")


def add_error_handlers(app: FastAPI, limits: dict[str, Range]) -> None:
    """Our HTTPError, Starlette's (unknown route, 405, ...) and FastAPI's validation errors, in the one shape.
    ``limits``: the ranges that validation messages name, field by field (both bodies' fields, one table)."""

    @app.exception_handler(HTTPError)
    async def http_error(request: Request, error: HTTPError) -> Response:
        return error_response(request, error.status, error.message, error.headers, error.param)

    @app.exception_handler(StarletteHTTPException)
    async def starlette_error(request: Request, error: StarletteHTTPException) -> Response:  # unknown route, 405, ...
        message = f"no route {request.method} {request.url.path}; see /docs" if error.status_code == 404 else str(error.detail)
        if error.status_code == 404 and request.url.path.startswith(OPENAI_ROUTES):
            message = (
                f"no route {request.method} {request.url.path}: this server has a base model, not a chat model; "
                "use POST /v1/completions (and GET /v1/models)"
            )
        if error.status_code == 400 and error.detail == FASTAPI_PARSE_FAILURE:
            message = await body_problem(request)
        return error_response(request, error.status_code, message, error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> Response:
        errors = list(error.errors())
        openai = request.url.path.startswith(OPENAI_PATHS)  # OpenAI answers every invalid request with 400
        status = 400 if openai or any(e["type"] == "json_invalid" for e in errors) else 422
        message = validation_message(errors, limits, body_fields(request), request.headers.get("content-type"))
        param = field_name(errors[0]["loc"]) if errors and errors[0]["type"] != "json_invalid" else None
        return error_response(request, status, message, param=param)


# FastAPI's words for a body json.loads raised on with other than a JSONDecodeError (bad UTF-8, nesting
# deep enough to exhaust the decoder's recursion): they do not say which.
FASTAPI_PARSE_FAILURE = "There was an error parsing the body"


async def body_problem(request: Request) -> str:
    """What is wrong with a body FastAPI could not parse, in the KServe codec's words (one reading of JSON)."""
    try:
        load_json(await request.body())  # the body FastAPI read is kept on the request
    except ProtocolError as problem:
        return str(problem)
    return FASTAPI_PARSE_FAILURE


def body_fields(request: Request) -> list[str]:
    """The fields of the matched route's body model, for the "allowed:" of an unknown field's message."""
    body = getattr(request.scope.get("route"), "body_field", None)  # FastAPI puts the matched route in the scope
    model = body.field_info.annotation if body is not None else None
    return list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []
