"""The inference service: KServe v2 for each graph, a text API, dynamic batching, metrics.

  GET  /v2, /v2/health/live, /v2/health/ready
  GET  /v2/models/{model}[/versions/{v}], .../ready
  POST /v2/models/{model}[/versions/{v}]/infer     JSON and binary tensors (tritonclient works as is)
  POST /v1/generate, /v1/reconstruct, /v1/encode   text in, text / ids / latents out
  GET  /metrics                                    Prometheus
  GET  /docs, /openapi.json                        OpenAPI

Graph requests go through one DynamicBatcher per graph; generation goes through the step-level
continuous-batching scheduler. Queues are bounded (503 with Retry-After when full), every request
has a timeout (504), bodies are capped (413), samples and tokens per request are capped (413),
large requests run in ``max_batch`` chunks, JSON is decoded and encoded off the event loop, slow
and idle connections are timed out (see http_guard), and nothing from a request is ever executed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import logging
import multiprocessing
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

import ldlm
from ldlm.pipeline import LDLMPipeline
from ldlm.serve.runtime.backends import NUMPY_DTYPES, BackendGraphs, GraphBackend, open_graphs, ort_providers, serving_limits
from ldlm.serve.runtime.batcher import DynamicBatcher
from ldlm.serve.api.http_guard import GuardMiddleware, HTTPError, JsonLogFormatter, error_body, guarded_protocol
from ldlm.serve.api.kserve import (HEADER_LENGTH, encode_infer_response, json_bytes, kserve_datatype, parse_body, requested_outputs,
                               tensor_metadata)
from ldlm.serve.api.limits import MAX_N, MAX_STEPS, MAX_TEXTS
from ldlm.serve.api.metrics import Metrics
from ldlm.serve.runtime.scheduler import GenerateRequest, GenerationScheduler
from ldlm.serve.runtime.torch_backends import length_buckets
from ldlm.serve.api.openai_api import OPENAI_PATHS, openai_limits, create_router as create_openai_router
from ldlm.serve.api.playground import create_router as create_playground_router
from ldlm.serve.api.streaming import SSE_HEADERS, GenerationStream, PreviewDecoder, generate_sse
from ldlm.serve.api.schemas import ERROR_RESPONSES, EncodeResponse, TextsResponse, field_name, request_models, validation_message

log = logging.getLogger("ldlm.serve")
MODEL_VERSION = "1"
# JSON larger than this is decoded and encoded in a worker process: in a thread, one json.loads or
# json.dumps call holds the GIL for its whole run (seconds for an 8 MB body on a busy machine),
# and the event loop, health probes included, waits that long.
JSON_WORKER_BYTES = 1 << 18
JSON_WORKER_ELEMENTS = 1 << 15


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "ort"
    max_batch: int = 16  # samples per graph execution; larger requests run in chunks of this size
    max_delay_ms: float = 0.0  # how long a batch waits for company; 0: whatever queued while the last ran
    max_queue: int = 256  # requests waiting per graph before 503
    request_timeout_s: float = 60.0
    max_body_bytes: int = 8 << 20
    max_n: int = MAX_N  # samples per /v1/generate request (ldlm generate's cap too)
    max_steps: int = MAX_STEPS  # ldlm generate's cap too
    max_texts: int = MAX_TEXTS
    max_request_samples: int = 64  # batch size of one /v2 infer request (413 above)
    max_request_tokens: int = 8192  # batch x seq of one /v2 infer request (413 above)
    header_timeout_s: float = 10.0  # a request's headers must arrive within this, else the connection closes
    body_timeout_s: float = 30.0  # its body within this, else 408
    keep_alive_s: float = 5.0  # an idle keep-alive connection closes after this
    max_connections: int = 1024  # above this the oldest idle connection is closed; all busy: 503
    api_key: str | None = None
    threads: int | None = None
    device: str = "cpu"  # torch backends (eager, compiled)
    precision: str = "fp32"
    provider: str = "cpu"  # ONNX Runtime: cpu, cuda, tensorrt
    preview_budget: float = 0.05  # share of wall time that decoding streamed previews may take
    trt_cuda_graphs: bool = False  # TensorRT engines replay CUDA graphs

    def __post_init__(self) -> None:
        checks = {"port": (self.port, 0, 65535), "max_batch": (self.max_batch, 1, 1 << 16), "max_queue": (self.max_queue, 1, 1 << 20),
                  "max_body_bytes": (self.max_body_bytes, 1024, 1 << 31), "max_n": (self.max_n, 1, 1 << 16),
                  "max_steps": (self.max_steps, 1, 1 << 20), "max_texts": (self.max_texts, 1, 1 << 16),
                  "max_request_samples": (self.max_request_samples, 1, 1 << 20), "max_request_tokens": (self.max_request_tokens, 1, 1 << 30),
                  "max_connections": (self.max_connections, 1, 1 << 20)}
        for name, (value, low, high) in checks.items():
            if not low <= value <= high:
                raise ValueError(f"{name}={value} is out of range; allowed: {low}..{high}")
        for name in ("request_timeout_s", "header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} is out of range; allowed: > 0")
        if not 0 < self.preview_budget <= 1:
            raise ValueError(f"preview_budget={self.preview_budget} is out of range; allowed: (0, 1]")
        if self.max_delay_ms < 0:
            raise ValueError(f"max_delay_ms={self.max_delay_ms} is out of range; allowed: >= 0")


class LDLMService:
    """Everything a server process holds: the graphs, their batchers, the scheduler, the metrics."""

    def __init__(self, source: str, settings: ServerSettings, progress: Callable[[str], None] | None = None) -> None:
        """``progress``: told (one line each) what preparing the service is doing, for a person waiting on ``ldlm serve``."""
        self.settings = settings
        self._scratch = None
        say = progress or (lambda line: None)
        if settings.backend == "ort" and (Path(source) / "model.safetensors").is_file():
            from ldlm.export.onnx_export import export_graphs

            say(f"exporting the checkpoint {source} to ONNX first (ort serves an export; `ldlm export` once and serve its "
                "directory to skip this at every start)")
            self._scratch = tempfile.TemporaryDirectory(prefix="ldlm-serve-")  # a checkpoint: export it first
            source = str(export_graphs(source, Path(self._scratch.name) / "onnx", progress=progress is not None).out)
        say(f"loading the graphs of {source} ({settings.backend})")
        graphs, config, tokenizer = open_graphs(settings.backend, source, settings.precision, ort_providers(settings.provider),
                                                settings.threads, settings.device, memory_arena=False, cuda_graphs=settings.trt_cuda_graphs)
        # Engines built with narrower profiles narrow what the service accepts (lengths) and how
        # many samples one execution takes; a larger request still runs, in chunks.
        config, self.max_batch = serving_limits(graphs, config, settings.max_batch)
        self.graphs, self.config = graphs, config
        self.metrics = Metrics()
        self.batchers = {
            name: DynamicBatcher(graph, self.max_batch, settings.max_delay_ms, settings.max_queue, self.metrics.observer(name),
                                 self.metrics.cancelled_samples.labels(name).inc)
            for name, graph in graphs.items()
        }
        self.batched_pipeline = LDLMPipeline(BackendGraphs(self.batchers), tokenizer, config=config)
        device = getattr(graphs["denoiser"], "device", "cpu")  # torch backends: the sampler runs on their device
        generation = LDLMPipeline(BackendGraphs(graphs), tokenizer, device, config=config, buckets=length_buckets(config.max_seq_len))
        self.scheduler = GenerationScheduler(generation, self.max_batch, "continuous", settings.max_queue * 16,
                                             observer=self.metrics.observer("generate"),
                                             on_drop=self.metrics.cancelled_samples.labels("generate").inc)
        self.json_workers = self._json_pool()
        self._in_flight = 0  # generation requests submitted and not yet answered (streams included)
        self._in_flight_lock = threading.Lock()
        # its own thread, never the scheduler's; its time budget applies while other generations are in flight
        self.previews = PreviewDecoder(generation, settings.preview_budget, lambda: self._in_flight > 1, self.metrics.observe_previews)
        self.ready = True
        say("ready")

    def submit_generation(self, spec: GenerateRequest, prefix: Any = None, on_preview: Any = None, preview_every: int = 0,
                          deadline_s: float | None = None) -> Future[Any]:
        """``scheduler.submit`` (which refuses what cannot meet ``deadline_s``), counted while in flight: a
        streamed request's previews are free of the preview budget only while it is the one generation in flight."""
        future = self.scheduler.submit(spec, prefix, on_preview, preview_every, deadline_s)
        with self._in_flight_lock:
            self._in_flight += 1
        future.add_done_callback(self._generation_done)
        return future

    def _generation_done(self, future: Future[Any]) -> None:
        with self._in_flight_lock:
            self._in_flight -= 1
        self.previews.nudge()  # a preview rest taken because of this request can end

    @staticmethod
    def _json_pool() -> ProcessPoolExecutor:
        # spawn, not fork: a forked copy of ONNX Runtime's and torch's thread pools can deadlock
        return ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))

    def submit_json(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run a JSON codec call in a worker process; a pool broken by a dead worker is replaced."""
        try:
            return self.json_workers.submit(fn, *args)
        except BrokenProcessPool:
            self.json_workers = self._json_pool()
            return self.json_workers.submit(fn, *args)

    def close(self) -> None:
        """Finish everything queued, then stop the workers (graceful shutdown)."""
        self.ready = False
        self.scheduler.close()
        self.previews.close()
        for batcher in self.batchers.values():
            batcher.close()
        for graph in self.graphs.values():
            graph.close()  # TensorRT-RTX: its runtime cache is kept for the next start
        self.json_workers.shutdown(wait=True, cancel_futures=True)
        if self._scratch is not None:
            self._scratch.cleanup()


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
    except asyncio.TimeoutError:
        future.cancel()
        raise HTTPError(504, f"request timed out after {limit_s if limit_s is not None else timeout_s:g} s") from None


async def run_blocking(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """Run ``fn`` on the default thread pool: nothing that scales with a request runs on the event loop."""
    return await wait(asyncio.get_running_loop().run_in_executor(None, fn, *args), timeout_s)


async def run_submit(fn: Callable[..., Any], *args: Any, cancel: Callable[[Any], None], timeout_s: float) -> Any:
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


def create_app(service: LDLMService) -> FastAPI:
    settings = service.settings
    config = service.config
    models = request_models(settings.max_n, settings.max_steps, settings.max_texts, config.max_seq_len, config.default_steps,
                            config.default_sampler, settings.request_timeout_s)
    body_models: dict[str, type[BaseModel]] = {}  # route -> its body model, for the names of its fields in messages
    completion_limits = openai_limits(settings, service.config.max_seq_len)  # what OpenAI-route validation messages name

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        yield
        await asyncio.get_running_loop().run_in_executor(None, service.close)  # drain, then stop
        log.info("shutdown complete")

    app = FastAPI(title="ldlm", version=ldlm.__version__, lifespan=lifespan, responses=ERROR_RESPONSES, docs_url=None, redoc_url=None,
                  description="LDLM inference: KServe v2 for the encoder, denoiser and decoder graphs, and a text API. "
                  f"Limits of this server: {settings.max_body_bytes} body bytes; {settings.max_request_samples} samples and "
                  f"{settings.max_request_tokens} tokens (batch x seq) per /v2 infer request; n, length, steps and texts "
                  "as in the request schemas.")
    app.state.service = service
    app.add_middleware(GuardMiddleware, service=service)  # type: ignore[arg-type]

    @app.exception_handler(HTTPError)
    async def http_error(request: Request, error: HTTPError) -> Response:
        return Response(error_body(error.message, error.status, request.url.path, error.param), error.status, error.headers,
                        "application/json")

    @app.exception_handler(StarletteHTTPException)
    async def starlette_error(request: Request, error: StarletteHTTPException) -> Response:  # unknown route, 405, ...
        message = f"no route {request.method} {request.url.path}; see /docs" if error.status_code == 404 else str(error.detail)
        return Response(error_body(message, error.status_code, request.url.path), error.status_code, error.headers, "application/json")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> Response:
        errors = list(error.errors())
        openai = request.url.path.startswith(OPENAI_PATHS)  # OpenAI answers every invalid request with 400
        status = 400 if openai or any(e["type"] == "json_invalid" for e in errors) else 422
        body_model = body_models.get(request.url.path)
        fields = list(body_model.model_fields) if body_model is not None else []
        message = validation_message(errors, completion_limits if openai else models.limits, fields)
        param = field_name(errors[0]["loc"]) if errors and errors[0]["type"] != "json_invalid" else None
        return Response(error_body(message, status, request.url.path, param), status, media_type="application/json")

    def model_or_404(name: str) -> str:
        if name not in service.graphs:
            raise HTTPError(404, f"unknown model {name!r}; available: {', '.join(service.graphs)}")
        return name

    @app.get("/v2")
    async def server_metadata() -> dict[str, Any]:
        return {"name": "ldlm", "version": ldlm.__version__, "extensions": ["binary_tensor_data"]}

    @app.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(status_code=200 if service.ready else 503)

    @app.get("/v2/models/{model}")
    @app.get("/v2/models/{model}/versions/{version}")
    async def model_metadata(model: str, version: str = MODEL_VERSION) -> dict[str, Any]:
        graph = service.graphs[model_or_404(model)]
        return {"name": model, "versions": [MODEL_VERSION], "platform": f"ldlm_{graph.backend}",
                "inputs": tensor_metadata(graph.inputs), "outputs": tensor_metadata(graph.outputs)}

    @app.get("/v2/models/{model}/ready")
    @app.get("/v2/models/{model}/versions/{version}/ready")
    async def model_ready(model: str, version: str = MODEL_VERSION) -> Response:
        model_or_404(model)
        return Response(status_code=200 if service.ready else 503)

    @app.post("/v2/models/{model}/infer")
    @app.post("/v2/models/{model}/versions/{version}/infer")
    async def infer(model: str, request: Request, version: str = MODEL_VERSION) -> Response:
        """KServe v2 inference: JSON or binary tensors in and out (tritonclient's default)."""
        graph = service.graphs[model_or_404(model)]
        body, encoding, header_length = await request.body(), request.headers.get("content-encoding"), request.headers.get(HEADER_LENGTH)
        json_size = int(header_length) if header_length is not None and header_length.isdigit() else len(body)
        parsed = await run_json(service, json_size > JSON_WORKER_BYTES or bool(encoding), parse_body, body, encoding, header_length,
                                settings.max_body_bytes)
        await run_blocking(check_infer_inputs, model, graph, parsed.inputs, settings, service.config.gpt2_vocab_size,
                           timeout_s=settings.request_timeout_s)
        unknown = [n for n, _ in parsed.outputs or [] if n not in graph.output_names]
        if unknown:
            raise HTTPError(400, f"unknown outputs {unknown}; {model} has {graph.output_names}")
        outputs = await wait(service.batchers[model].submit(parsed.inputs), settings.request_timeout_s)
        json_elements = sum(outputs[name].size for name, binary in requested_outputs(parsed, outputs) if not binary)
        content, headers = await run_json(service, json_elements > JSON_WORKER_ELEMENTS, encode_infer_response, model, MODEL_VERSION,
                                          parsed, outputs)
        return Response(content, headers=headers)

    async def generate(body: Any) -> Response:
        """Sample texts. Random-init checkpoints give gibberish. With `stream: true`: Server-Sent Events."""
        deadline = Deadline(settings.request_timeout_s if body.timeout_s is None else body.timeout_s)
        spec = GenerateRequest(body.n, body.length, body.steps, body.seed, body.sampler, body.t_min)
        # Submitting draws every sample's prior noise (n x length x d_model): off the event loop. The
        # scheduler refuses at once what it estimates cannot finish in the time left.
        submit = functools.partial(service.submit_generation, deadline_s=deadline.left())
        if body.stream:
            start = functools.partial(GenerationStream, submit, service.previews, spec, body.preview_every, loop=asyncio.get_running_loop())
            stream = await run_submit(start, cancel=lambda s: s.future.cancel(), timeout_s=deadline.left())
            return StreamingResponse(generate_sse(stream, deadline.left()), headers=SSE_HEADERS, media_type="text/event-stream")
        future = await run_submit(submit, spec, cancel=Future.cancel, timeout_s=deadline.left())
        result = await wait(future, deadline.left(), deadline.limit_s)  # cancelled here (disconnect, timeout): freed at the next step
        return await json_response(service, {"texts": result.texts, "token_ids": result.ids()})

    async def reconstruct(body: Any) -> Response:
        """Texts -> latents -> texts."""
        texts = list(body.texts)

        def run() -> dict[str, Any]:
            check_texts(texts, service.batched_pipeline)
            result = service.batched_pipeline.reconstruct(texts)
            return {"texts": result.texts, "token_ids": result.ids()}  # each text's own ids, no padded positions

        return await json_response(service, await run_blocking(run, timeout_s=settings.request_timeout_s))

    async def encode(body: Any) -> Response:
        """Texts -> standardized latents (B, L, D) and their attention mask."""
        texts = list(body.texts)

        def run() -> dict[str, Any]:
            check_texts(texts, service.batched_pipeline)
            result = service.batched_pipeline.encode(texts)
            return {"shape": list(result.latents.shape), "latents": result.latents.numpy(), "attention_mask": result.attention_mask.long().numpy()}

        return await json_response(service, await run_blocking(run, timeout_s=settings.request_timeout_s))

    # The body models carry this server's limits, so they are made per app and set here.
    routes: tuple[tuple[str, Callable[..., Any], type[BaseModel], type[BaseModel]], ...] = (
        ("/v1/generate", generate, models.generate, TextsResponse),
        ("/v1/reconstruct", reconstruct, models.texts, TextsResponse),
        ("/v1/encode", encode, models.texts, EncodeResponse))
    for path, handler, body_model, response_model in routes:
        handler.__annotations__ = {"body": body_model, "return": Response}
        app.post(path, response_model=response_model, summary=handler.__doc__)(handler)
        body_models[path] = body_model

    openai_router = create_openai_router(service)
    app.include_router(openai_router)
    body_models["/v1/completions"] = openai_router.body_model  # type: ignore[attr-defined]
    app.include_router(create_playground_router())

    @app.get("/metrics")
    async def metrics() -> Response:
        for name, batcher in service.batchers.items():
            service.metrics.queue_depth.labels(name).set(batcher.queued)
        for bucket, rate in service.scheduler.cost.rates().items():
            service.metrics.sample_step_rate.labels(str(bucket)).set(rate)
        service.metrics.queue_depth.labels("generate").set(service.scheduler.queued_samples)
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def check_infer_inputs(model: str, graph: GraphBackend, inputs: dict[str, np.ndarray], settings: ServerSettings, vocab: int) -> None:
    """What the service needs beyond the graph's contract: exact datatypes (no BOOL for INT64),
    masks of 0 and 1, ids in the vocabulary, and the per-request memory caps."""
    for spec in graph.inputs:
        name, array = spec["name"], inputs.get(spec["name"])
        if array is None:
            continue  # the batcher names missing inputs
        want = np.dtype(NUMPY_DTYPES[spec["dtype"]])
        if array.dtype != want:
            raise HTTPError(400, f"{model}: input {name} has datatype {kserve_datatype(array.dtype)}; allowed: {kserve_datatype(want)}")
        if array.ndim >= 1 and array.shape[0] > settings.max_request_samples:
            raise HTTPError(413, f"{model}: input {name} has {array.shape[0]} samples; allowed: 1..{settings.max_request_samples} "
                                 "per request (--max-request-samples)")
        if "seq" in spec["shape"] and array.ndim == len(spec["shape"]):
            tokens = array.shape[0] * array.shape[spec["shape"].index("seq")]
            if tokens > settings.max_request_tokens:
                raise HTTPError(413, f"{model}: input {name} has {tokens} tokens (batch x seq); allowed: up to "
                                     f"{settings.max_request_tokens} per request (--max-request-tokens)")
        if name == "attention_mask" and array.size:
            outside = (array != 0) & (array != 1)
            if outside.any():
                raise HTTPError(400, f"{model}: attention_mask holds {int(array[outside].flat[0])}; allowed: 0 or 1")
    ids = inputs.get("input_ids")
    if model == "encoder" and ids is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab):
        bad = int(ids.max() if ids.max() >= vocab else ids.min())
        raise HTTPError(400, f"input_ids contains {bad}; allowed: [0, {vocab}) (gpt2_vocab_size)")


def check_texts(texts: list[str], pipeline: LDLMPipeline) -> None:
    """Each text as the request names it (``texts[3]``): valid Unicode, and at most max_seq_len tokens."""
    limit = pipeline.config.max_seq_len
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise HTTPError(400, f"texts[{i}] is not valid Unicode ({error.reason} at character {error.start}); "
                                 "allowed: UTF-8 text") from None
    for i, ids in enumerate(pipeline.tokenizer.encode(texts)):
        if len(ids) > limit:
            raise HTTPError(400, f"texts[{i}] is {len(ids)} tokens long; allowed: 1..{limit} tokens (the model's max_seq_len)")


class PortInUseError(RuntimeError):
    """The port is taken; the message names it and how to choose another."""


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before anything is loaded or printed, so a busy port fails at once and cleanly."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise PortInUseError(f"port {port} on {host} is already in use (another `ldlm serve`?); choose another with "
                                 f"--port, e.g. --port {port + 1 if port < 65535 else 8000}, or stop the process that holds it") from None
        raise RuntimeError(f"cannot bind {host}:{port}: {error.strerror}; choose another --host or --port") from None
    sock.set_inheritable(True)
    return sock


def server_config(app: FastAPI, settings: ServerSettings) -> uvicorn.Config:
    """uvicorn with our connection layer: header deadline, idle-first shedding, keep-alive and body timeouts."""
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", access_log=False,
                          http=guarded_protocol(settings.header_timeout_s, settings.max_connections),
                          timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]
                          timeout_graceful_shutdown=int(settings.request_timeout_s) + 5, backlog=2048)


def serve(source: str, settings: ServerSettings, log_level: str = "info") -> None:
    """Bind (127.0.0.1 by default), load, serve until SIGINT/SIGTERM, then drain and exit."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter())
    log.handlers[:] = [handler]
    log.setLevel(log_level.upper())
    log.propagate = False
    sock = bind_socket(settings.host, settings.port)
    try:
        service = LDLMService(source, settings, progress=lambda line: print(f"ldlm serve: {line}", file=sys.stderr, flush=True))
        app = create_app(service)
        port = sock.getsockname()[1]
        url = f"http://{settings.host}:{port}"
        auth = " -H \"Authorization: Bearer $LDLM_API_KEY\"" if settings.api_key else ""  # the key itself is never printed
        print(f"ldlm serving {source} ({settings.backend}; {', '.join(f'{g}: {b.provider}' for g, b in service.graphs.items())}) on {url}", flush=True)
        print(f"try: curl -s {url}/v1/generate -H 'Content-Type: application/json'{auth} "
              f"-d '{{\"n\": 2, \"length\": 32, \"steps\": 20, \"seed\": 0, \"sampler\": \"ddim\"}}'", flush=True)
        print(f"docs: {url}/docs   metrics: {url}/metrics", flush=True)
        GracefulServer(server_config(app, settings)).run(sockets=[sock])
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
