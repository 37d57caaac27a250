"""What a server process holds and how it is set: ``ServerSettings`` and ``LDLMService``.

``LDLMService`` opens the graphs of one artifact, puts a ``DynamicBatcher`` in front of each graph, one
``LDLMPipeline`` over the batchers and a step-level ``GenerationScheduler`` in front of generation, and
owns the metrics and the JSON worker processes. It knows nothing of HTTP: the routers (``routes.kserve``, ``routes.text``,
``routes.openai``, ``routes.metrics``) are built from it.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ldlm.export.artifact import MANIFEST_FILE, read_schedules
from ldlm.export.onnx_export import export_graphs
from ldlm.limits import MAX_N, MAX_STEPS, MAX_TEXTS, PREVIEW_BUDGET, PREVIEW_LONE_BUDGET, SETTINGS, Range
from ldlm.model.config import SAMPLERS, LDLMConfig
from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling import GenerateRequest, RequestLimits, SamplingEngine
from ldlm.sampling.tuned_grids import TunedSchedules, checkpoint_schedules
from ldlm.serve.api.export_cache import cached_export
from ldlm.serve.api.metrics import Metrics
from ldlm.serve.api.schemas import BodyLimits
from ldlm.serve.runtime.backends import BackendGraphs, info_of, open_graphs, ort_providers, serving_limits
from ldlm.serve.runtime.batcher import DynamicBatcher
from ldlm.serve.runtime.graph_backend import GraphBackend
from ldlm.serve.runtime.registry import resolve_run
from ldlm.serve.runtime.scheduler import GenerationScheduler, PreviewShares
from ldlm.serve.runtime.torch_backends import fused_steps, length_buckets
from ldlm.serve.runtime.tracing import RequestTrace, Tracing

# Settings that may be None: threads (ONNX Runtime's own choice), grpc_port (no gRPC endpoint).
UNSET_ALLOWED = ("threads", "grpc_port")
# The generation queue holds samples, not requests: --max-queue requests of this many samples each.
QUEUED_SAMPLES_PER_REQUEST = 16


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = None  # KServe v2 over gRPC on this port of host beside HTTP (0: the OS picks one); None: none
    backend: str = ""  # "": none named, registry.resolve_run's for the device (the fast path on CUDA)
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
    precision: str = ""  # "": none named, registry.resolve_run's for the backend and device (fp16 for torch on CUDA)
    provider: str = "cpu"  # backend ort's ONNX Runtime providers: cpu, cuda, tensorrt
    preview_budget: float = PREVIEW_BUDGET  # share of wall time that decoding streamed previews may take beside other work
    preview_lone_budget: float = PREVIEW_LONE_BUDGET  # the same while a stream's own generation is the only one
    trt_cuda_graphs: bool = False  # TensorRT engines replay CUDA graphs
    export_cache: str | None = None  # a checkpoint on an export backend: where its verified export is kept (None: a scratch export)
    otlp_traces_endpoint: str | None = None  # OTLP/gRPC collector for traces; None: the OTEL_EXPORTER_OTLP_* variables', else off

    def __post_init__(self) -> None:
        backend, precision = resolve_run(self.device, self.backend, self.precision)  # "": none named
        object.__setattr__(self, "backend", backend)  # frozen: set once, here
        object.__setattr__(self, "precision", precision)
        for name, allowed in SETTINGS.items():  # the ranges `ldlm serve`'s options parse with
            value = getattr(self, name)
            if value is not None or name not in UNSET_ALLOWED:
                allowed.check(name, value)


class LDLMService:
    """Everything a server process holds: the graphs, their batchers, the scheduler, the metrics."""

    def __init__(self, source: str, settings: ServerSettings, progress: Callable[[str], None] | None = None) -> None:
        """``progress``: told (one line each) what preparing the service is doing, for a person waiting on ``ldlm serve``."""
        self.settings = settings
        self._scratch: tempfile.TemporaryDirectory[str] | None = None
        self.tracing = Tracing.start(settings.otlp_traces_endpoint, os.environ)  # first: a missing SDK fails before the graphs load
        say = progress or (lambda line: None)
        graphs, config, tokenizer = self._open_graphs(source, say, progress is not None)
        # Engines built with narrower profiles narrow what the service accepts (lengths) and how
        # many samples one execution takes; a larger request still runs, in chunks.
        config, self.max_batch = serving_limits(graphs, config, settings.max_batch)
        self.graphs, self.config = graphs, config
        self.metrics = Metrics()
        for name, graph in graphs.items():
            self.metrics.graph_info.labels(name, graph.backend, graph.provider, graph.precision).set(1)
        self.batchers = self._make_batchers(graphs)
        # One pipeline: every encode and decode (prompts, finished generations, previews, /v1 texts) goes
        # through the graphs' batchers. The scheduler batches the denoiser itself, step by step, on the
        # graphs' own device (torch backends: the sampler's state stays there, no host round trip per step).
        self.schedules = self._schedules(source, say, config)
        buckets = length_buckets(config.max_seq_len)
        self.pipeline = LDLMPipeline(BackendGraphs(self.batchers), tokenizer, config=config, buckets=buckets, schedules=self.schedules)
        self.scheduler = self._make_scheduler(graphs, config)
        self.json_workers = self._json_pool()
        self._in_flight = 0  # generation requests submitted and not yet answered (streams included)
        self._in_flight_lock = threading.Lock()
        self._watch(self.metrics)
        self.ready = True
        say("ready")

    def _watch(self, metrics: Metrics) -> None:
        """Queues, the running batch and the requests in flight, read by /metrics when it is scraped: an idle
        server reads zero everywhere, which is how a run checks that nothing was left behind."""
        for name, batcher in self.batchers.items():
            metrics.queue_depth.labels(name).set_function(functools.partial(getattr, batcher, "queued"))
        metrics.queue_depth.labels("generate").set_function(lambda: self.scheduler.queued_samples)
        metrics.active_samples.set_function(lambda: self.scheduler.active_samples)
        metrics.in_flight.set_function(lambda: self._in_flight)

    def _open_graphs(
        self, source: str, say: Callable[[str], None], progress: bool
    ) -> tuple[dict[str, GraphBackend], LDLMConfig, TextTokenizer]:
        """The graphs of ``source`` on the settings' backend; a checkpoint served on ort is exported first,
        into the settings' export cache (reused at the next start) or a scratch directory removed at close."""
        settings = self.settings
        quantize = "int8" if settings.precision == "int8" else None  # a checkpoint served in int8 is exported with its variants
        runs_export = info_of(settings.backend).opens == "export"
        if runs_export and is_checkpoint(source) and settings.export_cache is not None:
            source = str(cached_export(source, settings.export_cache, say, progress=progress, quantize=quantize).directory)
        elif runs_export and is_checkpoint(source):
            say(
                f"exporting the checkpoint {source} to ONNX first ({settings.backend} serves an export; `ldlm export` once and "
                "serve its directory to skip this at every start)"
            )
            self._scratch = tempfile.TemporaryDirectory(prefix="ldlm-serve-")
            source = export_checkpoint_for_serving(source, Path(self._scratch.name), progress=progress, quantize=quantize)
        say(f"loading the graphs of {source} ({settings.backend})")
        return open_graphs(
            settings.backend,
            source,
            settings.precision,
            ort_providers(settings.provider, settings.backend),
            settings.threads,
            settings.device,
            with_logits=True,  # torch backends: the decoder's logits, for temperature, top_p and logprobs
            memory_arena=False,
            cuda_graphs=settings.trt_cuda_graphs,
        )

    @staticmethod
    def _schedules(source: str, say: Callable[[str], None], config: LDLMConfig) -> TunedSchedules | None:
        """The tuned step grids of ``source`` (a checkpoint's schedules.json, or an export's), said at start."""
        if is_checkpoint(source):
            schedules = checkpoint_schedules(source)
        else:
            schedules = read_schedules(source) if (Path(source) / MANIFEST_FILE).is_file() else None
        if schedules is None:
            say("no tuned step grids (no schedules.json; `ldlm tune-schedule` makes one): each sampler's default grid")
        else:
            tuned = ", ".join(f"{s} at {n} steps" for s, n in schedules.defaults.items()) or "none matched DDIM@50"
            say(f"tuned step grids for {len(schedules.grids)} sampler/step counts; defaults: {tuned}")
            tau = config.effective_prior_temperature
            if not schedules.tuned_for(config.t_min, tau):
                say(
                    f"the tuned grids were tuned at t_min={schedules.t_min}, prior_temperature={schedules.prior_temperature}, and the "
                    f"config asks for t_min={config.t_min}, prior_temperature={tau}: each sampler's default grid until tuned again"
                )
        return schedules

    def _make_batchers(self, graphs: dict[str, GraphBackend]) -> dict[str, DynamicBatcher]:
        """A DynamicBatcher in front of each graph, reporting to the metrics."""
        settings = self.settings
        return {
            name: DynamicBatcher(
                graph,
                self.max_batch,
                settings.max_delay_ms,
                settings.max_queue,
                self.metrics.observer(name),
                self.metrics.cancelled_samples.labels(name).inc,
            )
            for name, graph in graphs.items()
        }

    def _make_scheduler(self, graphs: dict[str, GraphBackend], config: LDLMConfig) -> GenerationScheduler:
        """The step-level scheduler in front of generation, stepping the denoiser on the graphs' device."""
        device = getattr(graphs["denoiser"], "device", "cpu")
        return GenerationScheduler(
            self.pipeline,
            self.max_batch,
            "continuous",
            self.settings.max_queue * QUEUED_SAMPLES_PER_REQUEST,
            observer=self.metrics.observer("generate"),
            on_drop=self.metrics.cancelled_samples.labels("generate").inc,
            engine=SamplingEngine(self.pipeline.schedule, config.decode_final, device),
            denoise=BackendGraphs(graphs).denoise,
            limits=RequestLimits(self.settings.max_n, self.settings.max_steps),
            previews=PreviewShares(self.settings.preview_budget, self.settings.preview_lone_budget),
            on_previews=self.metrics.observe_previews,
            fused=fused_steps(graphs["denoiser"]),
            max_queue_source=f"--max-queue {self.settings.max_queue} requests x {QUEUED_SAMPLES_PER_REQUEST} samples each",
        )

    @functools.cached_property
    def request_ranges(self) -> dict[str, Range]:
        """Each bounded request field's range under this server's limits (``body_limits``'s), worked out once:
        every ldlm_generate request is checked against them."""
        return self.body_limits().ranges()

    def body_limits(self) -> BodyLimits:
        """The request bodies' limits (this server's settings, the model's max_seq_len) and, for /docs, what
        a request that names no sampler or steps gets: ``ldlm.sampling.resolve``'s plan, not a copy of its rule."""
        s, c = self.settings, self.config
        return BodyLimits(s.max_n, s.max_steps, s.max_texts, c.max_seq_len, s.request_timeout_s, self.default_plans())

    def default_plans(self) -> str:
        """The plan of a request naming nothing, and each sampler's default steps and grid, in words."""

        def said(sampler: str | None) -> str:
            try:
                plan = self.scheduler.plan(GenerateRequest(1, 1, sampler=sampler))
            except ValueError as error:  # a default above this server's max_steps: the request must name steps
                return str(error)
            return f"{plan.sampler.name} at {plan.steps} steps on the {plan.grid} grid"

        return f"a request naming neither gets {said(None)}; naming only the sampler: " + "; ".join(said(s) for s in SAMPLERS)

    def submit_generation(
        self,
        spec: GenerateRequest,
        prefix: Any = None,
        on_preview: Any = None,
        preview_every: int = 0,
        deadline_s: float | None = None,
        decoding: Any = None,
        trace: RequestTrace | None = None,
    ) -> Future[Any]:
        """``scheduler.submit`` (which refuses what cannot meet ``deadline_s``), counted while in flight.
        ``decoding``: its ``TokenSampling`` (None: argmax). ``trace``: the traced request it is part of (None: untraced)."""
        marks = trace.generation() if trace is not None else None
        future = self.scheduler.submit(spec, prefix, on_preview, preview_every, deadline_s, decoding, marks)
        with self._in_flight_lock:
            self._in_flight += 1
        future.add_done_callback(self._generation_done)
        return future

    def _generation_done(self, future: Future[Any]) -> None:
        with self._in_flight_lock:
            self._in_flight -= 1

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
        for batcher in self.batchers.values():
            batcher.close()
        for graph in self.graphs.values():
            graph.close()  # TensorRT-RTX: its runtime cache is kept for the next start
        self.json_workers.shutdown(wait=True, cancel_futures=True)
        if self._scratch is not None:
            self._scratch.cleanup()
        if self.tracing is not None:
            self.tracing.close()  # after the drain: the last requests' spans go out too


def is_checkpoint(source: str) -> bool:
    """A training checkpoint (weights to export), as opposed to an export's directory of graphs."""
    return (Path(source) / "model.safetensors").is_file()


def export_checkpoint_for_serving(checkpoint: str, scratch: Path, progress: bool, quantize: str | None = None) -> str:
    """ONNX Runtime serves an export, not a checkpoint: export ``checkpoint``'s graphs under ``scratch``
    (a directory the service removes at close) and return the export's directory, for ``open_graphs``.
    The decoder keeps its logits output, which temperature, top_p and logprobs draw from."""
    return str(export_graphs(checkpoint, scratch / "onnx", with_logits=True, progress=progress, quantize=quantize).out)
