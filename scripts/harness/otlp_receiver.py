"""A real OTLP trace receiver on 127.0.0.1, for the tests and the measuring scripts: OpenTelemetry's own
``TraceService`` (its protocol definitions from the ``opentelemetry-proto`` package) served over gRPC with grpcio,
as a collector serves it on 4317. Every span it is sent is kept, read back as a plain ``ReceivedSpan``.

    with OtlpReceiver() as receiver:            # receiver.endpoint: http://127.0.0.1:PORT
        ...                                     # a service exporting there (ldlm serve --otlp-traces-endpoint)
        spans = receiver.wait_for(lambda spans: any(s.name == "POST /v1/generate" for s in spans))
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def plain(value: AnyValue) -> Any:
    """An OTLP attribute value as Python's: a str, bool, int, float, or a list of them."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [plain(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a trace's root
    start_ns: int
    end_ns: int
    kind: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)  # (name, time ns, attributes)
    status: int = 0  # OTLP's status code: 0 unset, 1 ok, 2 error
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""  # the instrumentation scope's name
    trace_state: str = ""  # W3C tracestate, as the span carries it


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:
        if not self.receiver.keep:  # counted only: a measurement leaves a collector's work out of the service's
            self.receiver.add([], sum(len(scope.spans) for r in request.resource_spans for scope in r.scope_spans))
            return trace_service_pb2.ExportTraceServiceResponse()
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: plain(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                spans += [received(span, resource, scope.scope.name) for span in scope.spans]
        self.receiver.add(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def received(span: Any, resource: dict[str, Any], scope: str) -> ReceivedSpan:
    return ReceivedSpan(
        span.name,
        span.trace_id.hex(),
        span.span_id.hex(),
        span.parent_span_id.hex(),
        span.start_time_unix_nano,
        span.end_time_unix_nano,
        span.kind,
        {a.key: plain(a.value) for a in span.attributes},
        [(e.name, e.time_unix_nano, {a.key: plain(a.value) for a in e.attributes}) for e in span.events],
        span.status.code,
        resource,
        scope,
        span.trace_state,
    )


class OtlpReceiver:
    """OTLP/gRPC's TraceService on a free port of 127.0.0.1 while open; ``spans``: every span received, in arrival order."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep  # False: spans are counted, not kept (nor read back)
        self.spans: list[ReceivedSpan] = []
        self.count = 0  # spans received
        self.exports = 0  # Export calls answered
        self._cond = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def add(self, spans: list[ReceivedSpan], count: int | None = None) -> None:
        with self._cond:
            self.spans += spans
            self.count += len(spans) if count is None else count
            self.exports += 1
            self._cond.notify_all()

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """Every span received, once ``done`` holds of them; an AssertionError naming what came after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not done(self.spans):
                left = deadline - time.monotonic()
                assert left > 0, f"the spans expected did not arrive within {timeout_s:g} s; received: {[s.name for s in self.spans]}"
                self._cond.wait(left)
            return list(self.spans)

    def request(self, request_id: str, children: int, timeout_s: float = 30.0) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
        """The span of the request whose ``ldlm.request_id`` is ``request_id`` and its ``children`` child spans, once all
        came; the children in the order they started."""

        def root(spans: list[ReceivedSpan]) -> ReceivedSpan | None:
            return next((s for s in spans if s.attributes.get("ldlm.request_id") == request_id), None)

        def complete(spans: list[ReceivedSpan]) -> bool:
            found = root(spans)
            return found is not None and sum(s.parent_id == found.span_id for s in spans) >= children

        spans = self.wait_for(complete, timeout_s)
        found = root(spans)
        assert found is not None
        return found, sorted((s for s in spans if s.parent_id == found.span_id), key=lambda s: s.start_ns)

    def __enter__(self) -> OtlpReceiver:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(None)
