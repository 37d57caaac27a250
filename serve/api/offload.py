"""Keeping the event loop free: blocking calls run in threads, large JSON in worker processes, and every
wait is bounded by the request's deadline (504 after it), cancelling what it waited for.

In a thread, one json.loads or json.dumps call holds the GIL for its whole run (seconds for an 8 MB
body on a busy machine), and the event loop, health probes included, waits that long: JSON above
``JSON_WORKER_BYTES`` (bodies) or ``JSON_WORKER_ELEMENTS`` (values) is coded in a worker process.

A small KServe request is the exception: a body of at most ``INLINE_BODY_BYTES`` is decoded and checked,
and an answer of at most ``INLINE_JSON_VALUES`` JSON values and ``INLINE_BINARY_BYTES`` binary bytes is
encoded, on the event loop itself. Each thread hop costs two wake-ups and a GIL hand-off, about 0.1 to
0.3 ms on a busy 2-core machine, more than the work: these bounds keep that work under about 0.2 ms.
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
from fastapi.responses import Response

from ldlm.serve.api.errors import HTTPError
from ldlm.serve.api.kserve import InferRequest, encode_infer_response, infer_request_of, json_bytes, parse_body, requested_outputs
from ldlm.serve.api.service import LDLMService

JSON_WORKER_BYTES = 1 << 18
JSON_WORKER_ELEMENTS = 1 << 15
INLINE_BODY_BYTES = 1 << 14
INLINE_JSON_VALUES = 1 << 11
INLINE_BINARY_BYTES = 1 << 20


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


async def decode_infer_body(
    service: LDLMService, body: bytes, encoding: str | None, header_length: str | None, check: Callable[[InferRequest], None]
) -> InferRequest:
    """A KServe v2 infer body, decoded (and decompressed), then ``check``-ed: on the loop when small, else
    in one thread hop for both, or in a worker process (then ``check`` in a thread) when large or compressed."""
    limit = service.settings.max_body_bytes
    if not encoding and len(body) <= INLINE_BODY_BYTES:
        parsed = parse_body(body, encoding, header_length, limit)
        check(parsed)
        return parsed
    json_size = int(header_length) if header_length is not None and header_length.isdigit() else len(body)
    if json_size > JSON_WORKER_BYTES or bool(encoding):
        parsed = await run_json(service, True, parse_body, body, encoding, header_length, limit)
        await run_blocking(check, parsed, timeout_s=service.settings.request_timeout_s)
        return parsed

    def parse_and_check() -> InferRequest:
        parsed = parse_body(body, encoding, header_length, limit)
        check(parsed)
        return parsed

    return await run_blocking(parse_and_check, timeout_s=service.settings.request_timeout_s)


async def decode_infer_payload(
    service: LDLMService, payload: dict[str, Any], binary: bytes, values: int, check: Callable[[InferRequest], None]
) -> InferRequest:
    """A decoded infer header (a gRPC request's: ``values`` typed values in it) and its binary section, read by
    the codec and ``check``-ed: on the loop when as small as an inline body, else in one thread hop."""

    def read_and_check() -> InferRequest:
        parsed = infer_request_of(payload, memoryview(binary))
        check(parsed)
        return parsed

    if len(binary) <= INLINE_BODY_BYTES and values <= INLINE_JSON_VALUES:
        return read_and_check()
    return await run_blocking(read_and_check, timeout_s=service.settings.request_timeout_s)


async def encode_infer(
    service: LDLMService, model: str, version: str, parsed: InferRequest, outputs: dict[str, np.ndarray]
) -> tuple[bytes, dict[str, str]]:
    """The KServe v2 answer's body and headers: on the loop when small, else off it (a worker process when its JSON holds many values)."""
    wanted = requested_outputs(parsed, outputs)
    json_values = sum(outputs[name].size for name, binary in wanted if not binary)
    binary_bytes = sum(outputs[name].nbytes for name, binary in wanted if binary)
    if json_values <= INLINE_JSON_VALUES and binary_bytes <= INLINE_BINARY_BYTES:
        return encode_infer_response(model, version, parsed, outputs)
    return await run_json(service, json_values > JSON_WORKER_ELEMENTS, encode_infer_response, model, version, parsed, outputs)
