"""OpenTelemetry traces of the service's requests: off unless an OTLP endpoint is given (``ldlm serve
--otlp-traces-endpoint URL``, else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``), then
exported over OTLP/gRPC by the OpenTelemetry SDK through a ``BatchSpanProcessor``: a finished span is put on its
queue, and its own thread exports; a collector that is slow or down costs a request nothing (a full queue drops spans).

Off, nothing here runs per request: the service holds no ``Tracing`` and every request's ``RequestTrace`` is
None. On, a request carries a ``RequestTrace``: plain marks (``time.perf_counter`` readings) that the scheduler and
the batchers set as they pass them (``GenerationMarks``, ``BatchMarks``), never a span object in the step loop.
Its spans are built once it is answered (``RequestTrace.end``), with the marks as their times:

  the request's span (a child of the caller's W3C ``traceparent``, else the root of a new trace), and under it,
  for each generation:  ldlm.admission  planned, its prior drawn, priced against its deadline and queued
                        ldlm.queue      until its first sample took a slot
                        ldlm.steps      its steps, one span: how many, and the batch sizes it shared
                        ldlm.decode     its latents decoded to tokens and texts
                        ldlm.delivery   until its answer was sent
  for each graph batch: ldlm.queue, ldlm.batch (the batch assembled), ldlm.compute (the graph ran), ldlm.delivery

and each streamed preview an event ``ldlm.preview`` of the request's span, with its step. Attribute names are
OpenTelemetry's GenAI and HTTP/RPC semantic conventions' where one fits, ``ldlm.*`` otherwise.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
INSTALL = "pip install 'ldlm[otel]'"
SERVICE_NAME = "ldlm"
PROPAGATOR = TraceContextTextMapPropagator()
# The traced request the running task serves (set by the HTTP guard and the gRPC handlers while tracing is on),
# read where its work is handed to the scheduler or a batcher; None: not traced.
CURRENT: ContextVar[RequestTrace | None] = ContextVar("ldlm_request_trace", default=None)


def check_endpoint(url: str, name: str = "--otlp-traces-endpoint") -> str:
    """``url`` when it names an OTLP/gRPC collector (http or https, a host, an optional port), else a ValueError naming it."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (reading the port parses it: a bad one raises)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"{name}={url!r} is not a collector's URL; allowed: http://HOST:PORT or https://HOST:PORT (OTLP over gRPC, e.g. http://localhost:4317)"
        )
    return url


def traces_endpoint(option: str | None, environ: Mapping[str, str]) -> str | None:
    """Where traces go: ``option`` (--otlp-traces-endpoint), else the first OTLP endpoint variable set; None: tracing is off."""
    if option is not None:
        return check_endpoint(option)
    for variable in ENDPOINT_VARIABLES:
        if environ.get(variable):
            return check_endpoint(environ[variable], variable)
    return None


def check_protocol(environ: Mapping[str, str]) -> None:
    """Refuse an OTLP protocol variable that asks for another transport than the gRPC one this service exports with."""
    for variable in PROTOCOL_VARIABLES:
        protocol = environ.get(variable, "grpc")
        if protocol != "grpc":
            raise ValueError(
                f"{variable}={protocol!r} is unsupported; allowed: grpc (ldlm serve exports OTLP over gRPC), or leave it unset"
            )


class Tracing:
    """The SDK's tracer provider of one service, its batch processor exporting over OTLP/gRPC, and the sink its
    requests' spans go to."""

    def __init__(self, provider: Any, processor: Any) -> None:
        self.provider = provider
        self.sink = SpanSink(provider, processor)

    @classmethod
    def start(cls, option: str | None, environ: Mapping[str, str]) -> Tracing | None:
        """Tracing as ``option`` and ``environ`` set it (``traces_endpoint``); None when off. The exporter reads the other
        ``OTEL_EXPORTER_OTLP_*`` variables itself (headers, certificates, timeout, compression), the batch processor
        the ``OTEL_BSP_*`` ones (its queue, its delay), and the provider ``OTEL_TRACES_SAMPLER`` (default: the caller's
        decision, else every request)."""
        endpoint = traces_endpoint(option, environ)
        if endpoint is None:
            return None
        check_protocol(environ)
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # the SDK, only when tracing is on
            from opentelemetry.sdk.resources import Resource  # the SDK, only when tracing is on
            from opentelemetry.sdk.trace import TracerProvider  # the SDK, only when tracing is on
            from opentelemetry.sdk.trace.export import BatchSpanProcessor  # the SDK, only when tracing is on
        except ImportError as error:
            raise RuntimeError(f"tracing to {endpoint} needs the OpenTelemetry SDK and its OTLP exporter: {INSTALL} ({error})") from None
        provider = TracerProvider(resource=Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME}))
        processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))
        provider.add_span_processor(processor)  # the provider's flush and shutdown reach it
        return cls(provider, processor)

    def begin(self, name: str, carrier: Mapping[str, Any], attributes: dict[str, Any]) -> RequestTrace:
        """A request's trace, under the caller's span when ``carrier`` (its headers or gRPC metadata) has a ``traceparent``."""
        return RequestTrace(self.sink, name, PROPAGATOR.extract(carrier), attributes)

    def http_request(self, method: str, route: str, headers: Mapping[str, str], request_id: str, model: str) -> RequestTrace:
        """An HTTP request's trace: its span named as HTTP servers name theirs, ``METHOD route``."""
        attributes = {"http.request.method": method, "http.route": route, "ldlm.request_id": request_id, "gen_ai.request.model": model}
        return self.begin(f"{method} {route}", headers, attributes)

    def rpc_request(self, path: str, metadata: Mapping[str, Any], request_id: str, model: str) -> RequestTrace:
        """A gRPC call's trace (``path``: ``/package.Service/Method``): its span named as gRPC servers name theirs."""
        name = path.lstrip("/")
        service, method = name.split("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method, "ldlm.request_id": request_id}
        return self.begin(name, metadata, {**attributes, "gen_ai.request.model": model})

    def close(self) -> None:
        """Export what is queued (the exporter's own timeout bounds the wait), then stop."""
        self.provider.shutdown()


class SpanSink:
    """Where a request's spans go once it is answered: each built whole, times and all (the SDK's ``ReadableSpan``), and
    handed to the batch processor. A span here is only ever made after it ended, so the tracer's per-span work (a
    live span's lock, attribute checks, the processors' start hooks) is skipped: a fifth of its cost per request.
    The provider's sampler still decides, once per request, and its children follow."""

    def __init__(self, provider: Any, processor: Any) -> None:
        from opentelemetry.sdk.trace import Event, ReadableSpan  # the SDK, only when tracing is on
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator  # the SDK, only when tracing is on
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope  # the SDK, only when tracing is on

        self.sampler, self.resource, self.processor = provider.sampler, provider.resource, processor
        self.ids = RandomIdGenerator()
        self.scope = InstrumentationScope(__name__)  # the instrumentation scope: this module, as OpenTelemetry names one
        self.readable, self.event = ReadableSpan, Event

    def root(self, name: str, parent: Context, attributes: dict[str, Any]) -> tuple[trace.SpanContext, trace.SpanContext | None] | None:
        """A request span's context and its parent's (the caller's span; None: a new trace), or None when the sampler
        drops the request."""
        caller = trace.get_current_span(parent).get_span_context()
        trace_id = caller.trace_id if caller.is_valid else self.ids.generate_trace_id()
        decision = self.sampler.should_sample(parent, trace_id, name, trace.SpanKind.SERVER, attributes)
        if not decision.decision.is_sampled():
            return None
        flags = trace.TraceFlags(trace.TraceFlags.SAMPLED)
        own = trace.SpanContext(trace_id, self.ids.generate_span_id(), False, flags, decision.trace_state)
        return own, caller if caller.is_valid else None

    def child(self, parent: trace.SpanContext) -> trace.SpanContext:
        return trace.SpanContext(parent.trace_id, self.ids.generate_span_id(), False, parent.trace_flags, parent.trace_state)

    def emit(self, name: str, context: trace.SpanContext, parent: trace.SpanContext | None, times: tuple[int, int], **fields: Any) -> None:
        """One finished span (``fields``: attributes, kind, events as (name, attributes, ns), status) to the processor."""
        events = [self.event(event, attributes, at) for event, attributes, at in fields.pop("events", ())]
        span = self.readable(
            name,
            context,
            parent,
            self.resource,
            events=events,
            instrumentation_scope=self.scope,
            start_time=times[0],
            end_time=times[1],
            **fields,
        )
        self.processor.on_end(span)


@dataclass(eq=False)
class GenerationMarks:
    """One generation's way through the scheduler (``time.perf_counter`` readings; 0: not reached)."""

    submitted: float = field(default_factory=time.perf_counter)  # handed to the scheduler
    plan: dict[str, Any] = field(default_factory=dict)  # what runs (``SamplingPlan.summary``), n and length
    queued: float = 0.0  # planned, priced and queued
    started: float = 0.0  # its first sample took a slot
    steps: int = 0  # scheduler steps it had a sample in
    last_step: float = 0.0  # the end of the last of them
    batch_sizes: dict[int, int] = field(default_factory=dict)  # samples in a step it ran in -> how many such steps
    decoding: float = 0.0  # its decode began
    decoded: float = 0.0  # and ended

    def step(self, size: int, ended: float) -> None:
        """The scheduler ran a step of ``size`` samples, some of them this generation's, which ended at ``ended``."""
        self.steps += 1
        self.last_step = ended
        self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1


@dataclass(eq=False)
class BatchMarks:
    """One graph request's way through its dynamic batcher (``time.perf_counter`` readings; 0: not reached)."""

    queued: float = field(default_factory=time.perf_counter)
    taken: float = 0.0  # its batch left the queue
    assembled: float = 0.0  # the batch's inputs padded and joined
    computed: float = 0.0  # the graph's answer in
    size: int = 0  # samples in the batch

    def ran(self, taken: float, assembled: float, computed: float, size: int) -> None:
        """Its batch of ``size`` samples left the queue at ``taken``, was assembled and ran."""
        self.taken, self.assembled, self.computed, self.size = taken, assembled, computed, size


class RequestTrace:
    """One traced request: its span's name, parent and attributes, and the marks its spans are built from at ``end``."""

    def __init__(self, sink: SpanSink, name: str, parent: Context, attributes: dict[str, Any]) -> None:
        self.started = time.perf_counter()
        self._epoch_ns = time.time_ns() - round(self.started * 1e9)  # perf_counter readings -> Unix time in ns
        self.sink, self.name, self.parent, self.attributes = sink, name, parent, attributes
        self.generations: list[GenerationMarks] = []
        self.batches: list[BatchMarks] = []
        self.previews: list[tuple[float, int]] = []  # (when it was sent, its step)
        self.delivered = 0.0  # the answer's last byte handed to the transport

    def generation(self) -> GenerationMarks:
        """The marks of a generation this request starts (a completion with several prompts starts several)."""
        marks = GenerationMarks()
        self.generations.append(marks)
        return marks

    def batch(self) -> BatchMarks:
        """The marks of a graph request this request queues."""
        marks = BatchMarks()
        self.batches.append(marks)
        return marks

    def preview(self, step: int) -> None:
        """A preview of ``step`` was sent."""
        self.previews.append((time.perf_counter(), step))

    def ns(self, mark: float) -> int:
        return self._epoch_ns + round(mark * 1e9)

    def end(self, status: int) -> None:
        """Build and end the request's spans, its answer's HTTP ``status`` (a gRPC call's: the status its error maps to) told."""
        ended = time.perf_counter()
        delivered = self.delivered or ended
        # what the route set wins over what its generations tell (a completion counts its own output tokens)
        attributes = {**generation_attributes(self.generations), **self.attributes, "ldlm.status": status}
        sampled = self.sink.root(self.name, self.parent, attributes)
        if sampled is None:
            return
        context, caller = sampled
        for marks in self.generations:
            self._child(context, "ldlm.admission", marks.submitted, marks.queued)
            self._child(context, "ldlm.queue", marks.queued, marks.started)
            if marks.steps:
                self._child(context, "ldlm.steps", marks.started, marks.last_step, steps_attributes(marks))
            self._child(context, "ldlm.decode", marks.decoding, marks.decoded)
            self._child(context, "ldlm.delivery", marks.decoded, delivered)
        for batch in self.batches:
            self._child(context, "ldlm.queue", batch.queued, batch.taken)
            self._child(context, "ldlm.batch", batch.taken, batch.assembled, {"ldlm.batch.size": batch.size})
            self._child(context, "ldlm.compute", batch.assembled, batch.computed)
            self._child(context, "ldlm.delivery", batch.computed, delivered)
        events = [("ldlm.preview", {"ldlm.step": step}, self.ns(sent)) for sent, step in self.previews]
        outcome = trace.Status(trace.StatusCode.ERROR, f"answered {status}") if status >= 500 else trace.Status()
        times = (self.ns(self.started), self.ns(ended))
        self.sink.emit(self.name, context, caller, times, attributes=attributes, kind=trace.SpanKind.SERVER, events=events, status=outcome)

    def _child(self, context: trace.SpanContext, name: str, start: float, end: float, attributes: dict[str, Any] | None = None) -> None:
        """A child span from ``start`` to ``end``; none when the request never got that far (a mark is 0)."""
        if start and end:
            self.sink.emit(name, self.sink.child(context), context, (self.ns(start), self.ns(end)), attributes=attributes)


def steps_attributes(marks: GenerationMarks) -> dict[str, Any]:
    """The steps span's: how many steps, and the batch sizes it shared (each size once, ascending; the most, the mean)."""
    sizes = sorted(marks.batch_sizes)
    mean = sum(size * count for size, count in marks.batch_sizes.items()) / marks.steps
    return {"ldlm.steps": marks.steps, "ldlm.batch.sizes": sizes, "ldlm.batch.size.max": sizes[-1], "ldlm.batch.size.mean": mean}


def generation_attributes(generations: list[GenerationMarks]) -> dict[str, Any]:
    """The request's attributes its generations tell: the plan that ran, the samples (n) and their length; none without one."""
    plans = [marks.plan for marks in generations if marks.plan]
    if not plans:
        return {}
    n = sum(plan["n"] for plan in plans)
    length = max(plan["length"] for plan in plans)
    ran = {key: value for key, value in plans[0].items() if key not in ("n", "length")}
    return {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.choice.count": n,
        "gen_ai.request.max_tokens": length,
        "ldlm.plan": json.dumps(ran, sort_keys=True),
        "gen_ai.usage.output_tokens": sum(plan["n"] * plan["length"] for plan in plans),
    }
