"""The KServe v2 (Open Inference Protocol) routes: one model per graph and ``ldlm_generate`` (generation), as
Triton serves them from ``ldlm triton-repo``'s repository, and the same protocol over gRPC beside them
(``grpc_server``) for as long as the app runs, when one is asked for.

  GET  /v2, /v2/health/live, /v2/health/ready
  GET  /v2/models/{model}[/versions/{v}], .../ready, .../config     metadata, readiness, Triton's model config
  GET  /v2/models/stats, /v2/models/{model}[/versions/{v}]/stats     Triton's statistics
  POST /v2/repository/index                                          the served models and their state
  POST /v2/models/{model}[/versions/{v}]/infer     JSON and binary tensors (tritonclient works as is)

The codec is ``kserve``, the answers about models ``kserve_models``; each infer request, over either
transport, runs through ``serve_infer`` and its graph's ``DynamicBatcher`` (ldlm_generate's: the scheduler). ``infer_shortcut`` gives the
guard the infer route as a bare ASGI app, which it runs in place of FastAPI's routing, dependency solving
and response wrappers (about a third of a small request's time on the server); the FastAPI route stays
for the OpenAPI schema and runs the same ``answer_infer``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ldlm.serve.api.errors import HTTPError
from ldlm.serve.api.generate_model import check_outputs, infer_generate
from ldlm.serve.api.grpc_server import grpc_endpoint
from ldlm.serve.api.kserve import HEADER_LENGTH, InferRequest, kserve_datatype
from ldlm.serve.api.kserve_models import (
    GENERATE_LABEL,
    MODEL_VERSION,
    index_request,
    model_config,
    model_metadata,
    repository_index,
    served_model,
    server_metadata,
    statistics,
)
from ldlm.serve.api.offload import decode_infer_body, encode_infer, wait
from ldlm.serve.api.service import LDLMService, ServerSettings
from ldlm.serve.runtime.graph_backend import NUMPY_DTYPES, GraphBackend
from ldlm.serve.runtime.tracing import CURRENT

T = TypeVar("T")
# Token ids and masks come as INT32 from many Triton clients: an INT64 input takes them (the graph's contract
# check widens them, GraphBackend.check_inputs), as Triton's models commonly do.
ALSO_ACCEPTED: dict[np.dtype[Any], np.dtype[Any]] = {np.dtype(np.int64): np.dtype(np.int32)}


def create_router(service: LDLMService) -> APIRouter:
    router = APIRouter(lifespan=grpc_lifespan(service))

    @router.get("/v2")
    async def server_info() -> dict[str, Any]:
        return server_metadata()

    @router.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @router.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(status_code=200 if service.ready else 503)

    @router.get("/v2/models/stats")  # before /v2/models/{model}, which would take "stats" for a model's name
    async def all_statistics() -> dict[str, Any]:
        """Triton's statistics of every model."""
        return statistics(service)

    @router.get("/v2/models/{model}")
    @router.get("/v2/models/{model}/versions/{version}")
    async def model_info(model: str, version: str = MODEL_VERSION) -> dict[str, Any]:
        return model_metadata(service, model, version)

    @router.get("/v2/models/{model}/ready")
    @router.get("/v2/models/{model}/versions/{version}/ready")
    async def model_ready(model: str, version: str = MODEL_VERSION) -> Response:
        served_model(service, model, version)
        return Response(status_code=200 if service.ready else 503)

    @router.get("/v2/models/{model}/config")
    @router.get("/v2/models/{model}/versions/{version}/config")
    async def config(model: str, version: str = MODEL_VERSION) -> dict[str, Any]:
        """Triton's model configuration of the graph: dims without the batch axis, batching and queue limits."""
        return model_config(service, model, version)

    @router.get("/v2/models/{model}/stats")
    @router.get("/v2/models/{model}/versions/{version}/stats")
    async def model_statistics(model: str, version: str = MODEL_VERSION) -> dict[str, Any]:
        """Triton's statistics of one model: requests, queue and compute times, executions by batch size."""
        return statistics(service, model, version)

    @router.post("/v2/repository/index")
    async def index(request: Request) -> list[dict[str, str]]:
        """The served models and their state; the body is empty or ``{"ready": true}`` (ready ones only)."""
        return repository_index(service, index_request(await request.body()))

    @router.post("/v2/models/{model}/infer")
    @router.post("/v2/models/{model}/versions/{version}/infer")
    async def infer(model: str, request: Request, version: str = MODEL_VERSION) -> Response:
        """KServe v2 inference: JSON or binary tensors in and out (tritonclient's default)."""
        content, headers = await answer_infer(service, model, await request.body(), request.headers, version)
        return Response(content, headers=headers)

    return router


def grpc_lifespan(service: LDLMService) -> Callable[[Any], contextlib.AbstractAsyncContextManager[None]]:
    """The router's lifespan: the gRPC endpoint beside the routes while the app runs (when one is asked for)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        async with grpc_endpoint(service, functools.partial(serve_infer, service)):
            yield

    return lifespan


async def answer_infer(
    service: LDLMService, model: str, body: bytes, headers: Mapping[str, str], version: str = MODEL_VERSION
) -> tuple[bytes, dict[str, str]]:
    """One HTTP infer request, body to answer (body and headers)."""

    def decode(check: Callable[[InferRequest], None]) -> Awaitable[InferRequest]:
        return decode_infer_body(service, body, headers.get("content-encoding"), headers.get(HEADER_LENGTH.lower()), check)

    async def encode(parsed: InferRequest, outputs: dict[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
        return await encode_infer(service, model, MODEL_VERSION, parsed, outputs)

    return await serve_infer(service, model, version, decode, encode)


async def serve_infer(
    service: LDLMService,
    model: str,
    version: str,
    decode: Callable[[Callable[[InferRequest], None]], Awaitable[InferRequest]],
    encode: Callable[[InferRequest, dict[str, np.ndarray]], Awaitable[T]],
) -> T:
    """One KServe v2 infer request, whichever transport brought it: decoded by ``decode`` (an HTTP body's, or a
    gRPC request's) and checked with the check it is given, run in its graph's batcher, and answered by
    ``encode``; timed stage by stage for the statistics. ``ldlm_generate`` runs as /v1/generate does (generate_model)."""
    generation = served_model(service, model, version) is None
    check: Callable[[InferRequest], None] = check_outputs if generation else infer_check(service, model)

    def run(parsed: InferRequest) -> Awaitable[dict[str, np.ndarray]]:
        if generation:
            return infer_generate(service, parsed)
        trace = CURRENT.get()
        marks = trace.batch() if trace is not None else None
        return wait(service.batchers[model].submit(parsed.inputs, marks), service.settings.request_timeout_s)

    label = GENERATE_LABEL if generation else model
    with service.metrics.timed_infer(label) as clock:
        parsed = await decode(check)
        clock.decoded = time.perf_counter()
        outputs = await run(parsed)
        clock.computed = time.perf_counter()
        return await encode(parsed, outputs)


def infer_check(service: LDLMService, model: str) -> Callable[[InferRequest], None]:
    """What a decoded request of ``model`` must pass before it is queued: its inputs' values and caps, and outputs the graph has."""
    graph, settings = service.graphs[model], service.settings

    def check(parsed: InferRequest) -> None:
        check_infer_inputs(model, graph, parsed.inputs, settings, service.config.gpt2_vocab_size)
        unknown = [n for n, _ in parsed.outputs or [] if n not in graph.output_names]
        if unknown:
            raise HTTPError(400, f"unknown outputs {unknown}; {model} has {graph.output_names}")

    return check


ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def infer_shortcut(service: LDLMService) -> Callable[[dict[str, Any]], ASGIApp | None]:
    """For the guard: the infer route as a bare ASGI app for a scope that POSTs to it, else None. Errors
    are raised to the guard, which answers them in the one shape, as FastAPI's handlers would."""

    def route(scope: dict[str, Any]) -> ASGIApp | None:
        parts = scope["path"].split("/")  # "", "v2", "models", model, ["versions", version,] "infer"
        if scope["method"] != "POST" or parts[-1] != "infer" or parts[1:3] != ["v2", "models"] or not parts[3]:
            return None
        if len(parts) != 5 and not (len(parts) == 7 and parts[4] == "versions" and parts[5]):
            return None
        version = parts[5] if len(parts) == 7 else MODEL_VERSION

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            message = await receive()  # the guard has read the whole body; it replays it in one message
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            content, extra = await answer_infer(service, parts[3], message["body"], headers, version)
            raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
            await send({"type": "http.response.start", "status": 200, "headers": [*raw, (b"content-length", str(len(content)).encode())]})
            await send({"type": "http.response.body", "body": content})

        return app

    return route


def check_infer_inputs(model: str, graph: GraphBackend, inputs: dict[str, np.ndarray], settings: ServerSettings, vocab: int) -> None:
    """What the service needs beyond the graph's contract: exact datatypes (no BOOL for INT64; INT32 for INT64),
    masks of 0 and 1 with a real position in every row, times in [0, 1], ids in the vocabulary, and the
    per-request memory caps. Every backend's requests pass here; the graphs' internal calls do not."""
    for spec in graph.inputs:
        name, array = spec["name"], inputs.get(spec["name"])
        if array is None:
            continue  # the batcher names missing inputs
        want = np.dtype(NUMPY_DTYPES[spec["dtype"]])
        if array.dtype != want and array.dtype != ALSO_ACCEPTED.get(want):
            allowed = " or ".join(kserve_datatype(d) for d in (want, ALSO_ACCEPTED.get(want)) if d is not None)
            raise HTTPError(400, f"{model}: input {name} has datatype {kserve_datatype(array.dtype)}; allowed: {allowed}")
        if array.ndim >= 1 and array.shape[0] > settings.max_request_samples:
            raise HTTPError(
                413,
                f"{model}: input {name} has {array.shape[0]} samples; allowed: 1..{settings.max_request_samples} "
                "per request (--max-request-samples)",
            )
        if "seq" in spec["shape"] and array.ndim == len(spec["shape"]):
            tokens = array.shape[0] * array.shape[spec["shape"].index("seq")]
            if tokens > settings.max_request_tokens:
                raise HTTPError(
                    413,
                    f"{model}: input {name} has {tokens} tokens (batch x seq); allowed: up to "
                    f"{settings.max_request_tokens} per request (--max-request-tokens)",
                )
        if name == "attention_mask" and array.size:
            outside = (array != 0) & (array != 1)
            if outside.any():
                raise HTTPError(400, f"{model}: attention_mask holds {int(array[outside].flat[0])}; allowed: 0 or 1")
        check_values(model, name, array)
    ids = inputs.get("input_ids")
    if model == "encoder" and ids is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab):
        bad = int(ids.max() if ids.max() >= vocab else ids.min())
        raise HTTPError(400, f"input_ids contains {bad}; allowed: [0, {vocab}) (gpt2_vocab_size)")


def check_values(model: str, name: str, array: np.ndarray) -> None:
    """Values no graph can mean anything with, answered 400 rather than with zeros or latents from
    outside what the model knows: a diffusion time outside the schedule's domain [0, 1], and a row of
    attention_mask that is padding alone (its attention has no key to attend to)."""
    if name == "t" and array.size:
        times = array.reshape(-1)  # (B,): one time per sample
        outside = np.flatnonzero((times < 0) | (times > 1))
        if outside.size:
            row = int(outside[0])
            raise HTTPError(
                400, f"{model}: input t holds {float(times[row]):g} at row {row}; allowed: a number in [0, 1] (the diffusion time)"
            )
    if name == "attention_mask" and array.ndim == 2 and array.size:
        empty = np.flatnonzero(~array.any(axis=1))  # (B, L) -> rows without a 1
        if empty.size:
            raise HTTPError(
                400,
                f"{model}: input attention_mask row {int(empty[0])} is all zeros; allowed: at least one 1 (a real position) in every row",
            )
