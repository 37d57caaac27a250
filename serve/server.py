"""The inference service: KServe v2 for each graph, a text API, dynamic batching, metrics.

  GET  /v2, /v2/health/live, /v2/health/ready
  GET  /v2/models/{model}[/versions/{v}], .../ready
  POST /v2/models/{model}[/versions/{v}]/infer     JSON and binary tensors (tritonclient works as is)
  POST /v1/generate, /v1/reconstruct, /v1/encode   text in, text / ids / latents out
  GET  /metrics                                    Prometheus
  GET  /docs, /openapi.json                        OpenAPI

Graph requests go through one DynamicBatcher per graph; generation goes through the step-level
continuous-batching scheduler. Queues are bounded (503 with Retry-After when full), every request
has a timeout (504), bodies are capped (413), and nothing from a request is ever executed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

import ldlm
from ldlm.pipeline import LDLMPipeline
from ldlm.serve.backends import BackendGraphs, open_graphs, ort_providers
from ldlm.serve.batcher import DynamicBatcher
from ldlm.serve.kserve import HEADER_LENGTH, decompress, encode_infer_response, parse_infer_request, tensor_metadata
from ldlm.serve.http_guard import GuardMiddleware, HTTPError, JsonLogFormatter
from ldlm.serve.metrics import Metrics
from ldlm.serve.scheduler import GenerateRequest, GenerationScheduler

log = logging.getLogger("ldlm.serve")
MODEL_VERSION = "1"


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "ort"
    max_batch: int = 16  # samples per graph execution
    max_delay_ms: float = 0.0  # how long a batch waits for company; 0: whatever queued while the last ran
    max_queue: int = 256  # requests waiting per graph before 503
    request_timeout_s: float = 60.0
    max_body_bytes: int = 8 << 20
    max_n: int = 64  # samples per /v1/generate request
    max_steps: int = 1000
    max_texts: int = 64
    api_key: str | None = None
    threads: int | None = None
    device: str = "cpu"  # torch backends (eager, compiled)
    precision: str = "fp32"
    provider: str = "cpu"  # ONNX Runtime: cpu, cuda, tensorrt

    def __post_init__(self) -> None:
        checks = {"port": (self.port, 0, 65535), "max_batch": (self.max_batch, 1, 1 << 16), "max_queue": (self.max_queue, 1, 1 << 20),
                  "max_body_bytes": (self.max_body_bytes, 1024, 1 << 31), "max_n": (self.max_n, 1, 1 << 16),
                  "max_steps": (self.max_steps, 1, 1 << 20), "max_texts": (self.max_texts, 1, 1 << 16)}
        for name, (value, low, high) in checks.items():
            if not low <= value <= high:
                raise ValueError(f"{name}={value} is out of range; allowed: {low}..{high}")
        if self.request_timeout_s <= 0 or self.max_delay_ms < 0:
            raise ValueError("request_timeout_s must be > 0 and max_delay_ms >= 0")


class GenerateBody(BaseModel):
    n: int = Field(1, ge=1, description="samples to generate")
    length: int = Field(64, ge=1, description="tokens per sample")
    steps: int = Field(50, ge=1, description="denoising steps")
    seed: int = Field(0, ge=0, lt=2**63, description="noise seed")
    sampler: Literal["sde", "ddim"] = Field("sde", description="sde: Euler-Maruyama; ddim: deterministic")
    t_min: float | None = Field(None, gt=0, lt=1, description="last time of the grid")


class TextsBody(BaseModel):
    texts: list[str] = Field(..., min_length=1, description="input texts")


class LDLMService:
    """Everything a server process holds: the graphs, their batchers, the scheduler, the metrics."""

    def __init__(self, source: str, settings: ServerSettings) -> None:
        self.settings = settings
        self._scratch = None
        if settings.backend == "ort" and (Path(source) / "model.safetensors").is_file():
            from ldlm.export.onnx_export import export_graphs

            self._scratch = tempfile.TemporaryDirectory(prefix="ldlm-serve-")  # a checkpoint: export it first
            source = str(export_graphs(source, Path(self._scratch.name) / "onnx").out)
        graphs, config, tokenizer = open_graphs(settings.backend, source, settings.precision, ort_providers(settings.provider),
                                                settings.threads, settings.device)
        self.graphs, self.config = graphs, config
        self.metrics = Metrics()
        self.batchers = {
            name: DynamicBatcher(graph, settings.max_batch, settings.max_delay_ms, settings.max_queue, self.metrics.observer(name))
            for name, graph in graphs.items()
        }
        buckets = tuple(b for b in (16, 32, 64, 128, 256, 512, 1024) if b <= config.max_seq_len) + (config.max_seq_len,)
        self.batched_pipeline = LDLMPipeline(BackendGraphs(self.batchers), tokenizer, config=config)
        device = getattr(graphs["denoiser"], "device", "cpu")  # torch backends: the sampler runs on their device
        generation = LDLMPipeline(BackendGraphs(graphs), tokenizer, device, config=config, buckets=buckets)
        self.scheduler = GenerationScheduler(generation, settings.max_batch, "continuous", settings.max_queue * 16,
                                             observer=self.metrics.observer("generate"))
        self.ready = True

    def close(self) -> None:
        """Finish everything queued, then stop the workers (graceful shutdown)."""
        self.ready = False
        self.scheduler.close()
        for batcher in self.batchers.values():
            batcher.close()
        if self._scratch is not None:
            self._scratch.cleanup()


async def wait(future: Future[Any] | asyncio.Future[Any], timeout_s: float) -> Any:
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
    except asyncio.TimeoutError:
        future.cancel()
        raise HTTPError(504, f"request timed out after {timeout_s:g} s") from None


def create_app(service: LDLMService) -> FastAPI:
    settings = service.settings

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        yield
        await asyncio.get_running_loop().run_in_executor(None, service.close)  # drain, then stop
        log.info("shutdown complete")

    app = FastAPI(title="ldlm", version=ldlm.__version__, lifespan=lifespan,
                  description="LDLM inference: KServe v2 for the encoder, denoiser and decoder graphs, and a text API.")
    app.state.service = service
    app.add_middleware(GuardMiddleware, service=service)  # type: ignore[arg-type]

    @app.exception_handler(HTTPError)
    async def http_error(request: Request, error: HTTPError) -> JSONResponse:
        return JSONResponse({"error": error.message}, error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = [f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in error.errors()]
        return JSONResponse({"error": "; ".join(problems), "detail": json.loads(json.dumps(error.errors(), default=str))}, 422)

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
        model_or_404(model)
        body = decompress(await request.body(), request.headers.get("content-encoding"), settings.max_body_bytes)
        parsed = parse_infer_request(body, request.headers.get(HEADER_LENGTH))
        if model == "encoder" and "input_ids" in parsed.inputs:
            check_ids(parsed.inputs["input_ids"], service.config.gpt2_vocab_size)
        unknown = [n for n, _ in parsed.outputs or [] if n not in service.graphs[model].output_names]
        if unknown:
            raise HTTPError(400, f"unknown outputs {unknown}; {model} has {service.graphs[model].output_names}")
        outputs = await wait(service.batchers[model].submit(parsed.inputs), settings.request_timeout_s)
        content, headers = encode_infer_response(model, MODEL_VERSION, parsed, outputs)
        return Response(content, headers=headers)

    @app.post("/v1/generate")
    async def generate(body: GenerateBody) -> dict[str, Any]:
        """Sample texts. Random-init checkpoints give gibberish."""
        if body.n > settings.max_n:
            raise HTTPError(422, f"n: {body.n} is out of range; allowed: 1..{settings.max_n}")
        if body.steps > settings.max_steps:
            raise HTTPError(422, f"steps: {body.steps} is out of range; allowed: 1..{settings.max_steps}")
        future = service.scheduler.submit(GenerateRequest(body.n, body.length, body.steps, body.seed, body.sampler, body.t_min))
        result = await wait(future, settings.request_timeout_s)
        return {"texts": result.texts, "token_ids": result.token_ids.tolist()}

    @app.post("/v1/reconstruct")
    async def reconstruct(body: TextsBody) -> dict[str, Any]:
        """Texts -> latents -> texts."""
        check_texts(body.texts, settings.max_texts)
        result = await run_blocking(service.batched_pipeline.reconstruct, body.texts, settings.request_timeout_s)
        return {"texts": result.texts, "token_ids": result.token_ids.tolist()}

    @app.post("/v1/encode")
    async def encode(body: TextsBody) -> dict[str, Any]:
        """Texts -> standardized latents (B, L, D) and their attention mask."""
        check_texts(body.texts, settings.max_texts)
        result = await run_blocking(service.batched_pipeline.encode, body.texts, settings.request_timeout_s)
        return {"shape": list(result.latents.shape), "latents": result.latents.tolist(), "attention_mask": result.attention_mask.long().tolist()}

    @app.get("/metrics")
    async def metrics() -> Response:
        for name, batcher in service.batchers.items():
            service.metrics.queue_depth.labels(name).set(batcher.queued)
        service.metrics.queue_depth.labels("generate").set(service.scheduler.queued_samples)
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def check_ids(ids: np.ndarray, vocab: int) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        bad = int(ids.max() if ids.max() >= vocab else ids.min())
        raise HTTPError(400, f"input_ids contains {bad}; allowed: [0, {vocab}) (gpt2_vocab_size)")


def check_texts(texts: list[str], limit: int) -> None:
    if len(texts) > limit:
        raise HTTPError(422, f"texts: {len(texts)} items is out of range; allowed: 1..{limit}")


async def run_blocking(fn: Any, arg: Any, timeout_s: float) -> Any:
    return await wait(asyncio.get_running_loop().run_in_executor(None, fn, arg), timeout_s)


def serve(source: str, settings: ServerSettings, log_level: str = "info") -> None:
    """Load, bind (127.0.0.1 by default), serve until SIGINT/SIGTERM, then drain and exit."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter())
    log.handlers[:] = [handler]
    log.setLevel(log_level.upper())
    log.propagate = False
    service = LDLMService(source, settings)
    app = create_app(service)
    url = f"http://{settings.host}:{settings.port}"
    auth = f" -H 'Authorization: Bearer {settings.api_key}'" if settings.api_key else ""
    print(f"ldlm serving {source} ({settings.backend}; {', '.join(f'{g}: {b.provider}' for g, b in service.graphs.items())}) on {url}", flush=True)
    print(f"try: curl -s {url}/v1/generate -H 'Content-Type: application/json'{auth} "
          f"-d '{{\"n\": 2, \"length\": 32, \"steps\": 20, \"seed\": 0, \"sampler\": \"ddim\"}}'", flush=True)
    print(f"docs: {url}/docs   metrics: {url}/metrics", flush=True)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=int(settings.request_timeout_s) + 5, limit_concurrency=4 * settings.max_queue)
    GracefulServer(config).run()


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
