"""Keeping the event loop free: blocking calls run in threads, large JSON in worker processes, and every
wait is bounded by the request's deadline (504 after it), cancelling what it waited for.

In a thread, one json.loads or json.dumps call holds the GIL for its whole run (seconds for an 8 MB
body on a busy machine), and the event loop, health probes included, waits that long: JSON above
``JSON_WORKER_BYTES`` (bodies) or ``JSON_WORKER_ELEMENTS`` (values) is coded in a worker process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from ldlm.serve.api.errors import HTTPError
from ldlm.serve.api.kserve import HEADER_LENGTH, InferRequest, encode_infer_response, json_bytes, parse_body, requested_outputs
from ldlm.serve.api.service import LDLMService

JSON_WORKER_BYTES = 1 << 18
JSON_WORKER_ELEMENTS = 1 << 15


@dataclass(frozen=True)
class Deadline:
    """A request's time limit, counted from its handler's start: the server's timeout, or the request's own shorter ``timeout_s``."""

    limit_s: float
    start: float = dataclasses.field(default_factory=time.monotonic)

    def left(self) -> float:
        return max(0.001, self.limit_s - (time.monotonic() - self.start))


async def wait(future: Future[Any] | asyncio.Future[Any], timeout_s: float, limit_s: float | None = None) -> Any:
    """The future's result, or 504 after ``timeout_s`` (the message names ``limit_s``, the whole limit, when given);
    either way the future is cancelled when left, which frees whatever it holds."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future) if isinstance(future, Future) else future, timeout_s)
    except TimeoutError:
        future.cancel()
        raise HTTPError(504, f"request timed out after {limit_s if limit_s is not None else timeout_s:g} s") from None


async def run_blocking(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """Run ``fn`` on the default thread pool: nothing that scales with a request runs on the event loop."""
    return await wait(asyncio.get_running_loop().run_in_executor(None, fn, *args), timeout_s)


async def run_submit(fn: Callable[..., Any], *args: Any, cancel: Callable[[Any], object], timeout_s: float) -> Any:
    """``run_blocking`` for a call that queues work and returns a handle to it (a future, a stream):
    when this request is cancelled (its client left, its time ran out) while the call still runs in
    its thread, ``cancel`` is applied to the handle as soon as the call returns, or the work it queued
    would run for nobody."""
    call = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    try:
        return await wait(asyncio.shield(call), timeout_s)
    except BaseException:
        call.add_done_callback(lambda done: None if done.cancelled() or done.exception() is not None else cancel(done.result()))
        raise


async def run_json(service: LDLMService, heavy: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """A JSON codec call: in a worker process when ``heavy`` (no GIL shared with the loop), else in a thread."""
    if heavy:
        try:
            return await wait(service.submit_json(fn, *args), service.settings.request_timeout_s)
        except BrokenProcessPool:
            raise HTTPError(503, "a JSON worker process died during this request; retry", {"Retry-After": "1"}) from None
    return await run_blocking(fn, *args, timeout_s=service.settings.request_timeout_s)


def json_elements(payload: dict[str, Any]) -> int:
    """How many values a payload holds: arrays' sizes, and lists (``result.ids()``) to two levels deep,
    counted without walking every element (this runs on the event loop)."""
    count = 0
    for value in payload.values():
        if isinstance(value, np.ndarray):
            count += value.size
        elif isinstance(value, list):
            count += len(value) + sum(len(row) for row in value if isinstance(row, (list, np.ndarray)))
    return count


async def json_response(service: LDLMService, payload: dict[str, Any]) -> Response:
    content = await run_json(service, json_elements(payload) > JSON_WORKER_ELEMENTS, json_bytes, payload)
    return Response(content, media_type="application/json")


async def parse_infer_body(service: LDLMService, request: Request) -> InferRequest:
    """A KServe v2 infer body, decoded (and decompressed) off the loop: in a worker process when large or compressed."""
    body, encoding, header_length = await request.body(), request.headers.get("content-encoding"), request.headers.get(HEADER_LENGTH)
    json_size = int(header_length) if header_length is not None and header_length.isdigit() else len(body)
    return await run_json(
        service, json_size > JSON_WORKER_BYTES or bool(encoding), parse_body, body, encoding, header_length, service.settings.max_body_bytes
    )


async def infer_response(service: LDLMService, model: str, version: str, parsed: InferRequest, outputs: dict[str, np.ndarray]) -> Response:
    """The KServe v2 answer, encoded off the loop: in a worker process when its JSON holds many values."""
    json_values = sum(outputs[name].size for name, binary in requested_outputs(parsed, outputs) if not binary)
    content, headers = await run_json(service, json_values > JSON_WORKER_ELEMENTS, encode_infer_response, model, version, parsed, outputs)
    return Response(content, headers=headers)
