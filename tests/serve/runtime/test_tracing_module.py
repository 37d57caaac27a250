"""serve/runtime/tracing.py on its own: where traces go (the option, the OTLP variables, their checks), the SDK's
absence, and the spans a request's marks become, received over OTLP/gRPC by a real receiver
(scripts/harness/otlp_receiver.py): names, parents, times, attributes, events and status."""

from __future__ import annotations

import builtins
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the OpenTelemetry SDK (pip install -e .[otel] or .[test])")
pytest.importorskip("opentelemetry.proto", reason="the receiver's protocol definitions (pip install -e .[test])")

from ldlm.serve.runtime import tracing  # noqa: E402
from ldlm.serve.runtime.tracing import (  # noqa: E402
    CURRENT,
    BatchMarks,
    GenerationMarks,
    RequestTrace,
    Tracing,
    check_endpoint,
    check_protocol,
    generation_attributes,
    steps_attributes,
    traces_endpoint,
)
from scripts.harness.loopback import free_port  # noqa: E402
from scripts.harness.otlp_receiver import OtlpReceiver  # noqa: E402

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER}-01"
PLAN = {"sampler": "ddim", "steps": 4, "grid": "uniform", "n": 2, "length": 8}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def traces(receiver: OtlpReceiver) -> Iterator[Tracing]:
    started = Tracing.start(receiver.endpoint, {})
    assert started is not None
    yield started
    started.close()


def sent(traces: Tracing, receiver: OtlpReceiver, trace: RequestTrace, status: int, children: int) -> tuple[Any, list[Any]]:
    trace.end(status)
    traces.provider.force_flush()
    return receiver.request(trace.attributes["ldlm.request_id"], children, timeout_s=10)


def request(traces: Tracing, request_id: str, carrier: dict[str, str] | None = None) -> RequestTrace:
    return traces.http_request("POST", "/v1/generate", carrier or {}, request_id, "ldlm")


# --- where traces go -------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["http://localhost:4317", "https://collector.example:443", "http://10.0.0.7", "http://[::1]:4317"])
def test_a_collectors_url_is_taken(url: str) -> None:
    assert check_endpoint(url) == url


@pytest.mark.parametrize("url", ["localhost:4317", "ftp://host:21", "http://", "http://host:99999", "http://host:port", ""])
def test_anything_else_is_refused_naming_the_value(url: str) -> None:
    with pytest.raises(ValueError) as refused:
        check_endpoint(url)
    assert str(refused.value) == (
        f"--otlp-traces-endpoint={url!r} is not a collector's URL; allowed: http://HOST:PORT or https://HOST:PORT "
        "(OTLP over gRPC, e.g. http://localhost:4317)"
    )


def test_the_option_wins_over_the_variables_and_the_traces_variable_over_the_general_one() -> None:
    both = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:1", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://all:2"}
    assert traces_endpoint("http://option:3", both) == "http://option:3"
    assert traces_endpoint(None, both) == "http://traces:1"
    assert traces_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://all:2"}) == "http://all:2"
    assert (
        traces_endpoint(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://all:2"}) == "http://all:2"
    )
    assert traces_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": ""}) is None
    assert traces_endpoint(None, {}) is None


def test_a_bad_option_or_variable_is_named() -> None:
    with pytest.raises(ValueError, match=r"^--otlp-traces-endpoint='nope' is not"):
        traces_endpoint("nope", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://all:2"})
    with pytest.raises(ValueError, match=r"^OTEL_EXPORTER_OTLP_ENDPOINT='all:2' is not"):
        traces_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "all:2"})


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"])
def test_only_the_grpc_protocol_is_taken(variable: str) -> None:
    check_protocol({})
    check_protocol({variable: "grpc"})
    with pytest.raises(ValueError) as refused:
        check_protocol({variable: "http/protobuf"})
    assert (
        str(refused.value)
        == f"{variable}='http/protobuf' is unsupported; allowed: grpc (ldlm serve exports OTLP over gRPC), or leave it unset"
    )


def test_off_without_an_endpoint_and_a_protocol_refused_before_anything_starts() -> None:
    assert Tracing.start(None, {}) is None
    assert Tracing.start(None, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) is None  # off: nothing to refuse
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        Tracing.start("http://localhost:4317", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})


def test_without_the_sdk_tracing_refuses_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_sdk(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("opentelemetry.sdk"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sdk)
    assert Tracing.start(None, {}) is None  # off: the SDK is never looked for
    with pytest.raises(RuntimeError) as refused:
        Tracing.start("http://localhost:4317", {})
    assert str(refused.value).startswith(
        "tracing to http://localhost:4317 needs the OpenTelemetry SDK and its OTLP exporter: pip install 'ldlm[otel]' (No module named"
    )


def test_an_endpoint_from_the_variables_reaches_the_receiver_with_the_service_name(receiver: OtlpReceiver) -> None:
    traces = Tracing.start(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint, "OTEL_SERVICE_NAME": "named"})
    assert traces is not None
    root, _ = sent(traces, receiver, request(traces, "from-env"), 200, 0)
    traces.close()
    assert root.resource["service.name"] == "named"


def test_closing_sends_what_is_queued(receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")  # no export on its own within the test
    traces = Tracing.start(receiver.endpoint, {})
    assert traces is not None
    request(traces, "at-close").end(200)
    traces.close()
    root, _ = receiver.request("at-close", 0, timeout_s=1)
    assert root.resource["service.name"] == "ldlm"


def test_a_request_never_waits_on_a_collector_that_is_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spans are queued for the exporter's own thread: ending a request's trace costs no export, even one that fails."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "1")  # the exporter tries, and fails, while the traces end
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "2")
    traces = Tracing.start(f"http://127.0.0.1:{free_port()}", {})  # nothing listens there
    assert traces is not None
    started = time.perf_counter()
    for i in range(20):
        trace = request(traces, f"down-{i}")
        trace.generation().plan = dict(PLAN)
        trace.end(200)
    assert time.perf_counter() - started < 0.5  # one failed export alone takes seconds
    traces.close()


# --- a request's spans ---------------------------------------------------------------------------------


def test_a_traceparent_is_the_parent_and_none_starts_a_trace(traces: Tracing, receiver: OtlpReceiver) -> None:
    child, _ = sent(traces, receiver, request(traces, "child", {"traceparent": TRACEPARENT}), 200, 0)
    assert (child.trace_id, child.parent_id) == (TRACE_ID, CALLER)
    own, _ = sent(traces, receiver, request(traces, "own"), 200, 0)
    assert own.parent_id == "" and own.trace_id != TRACE_ID and len(own.trace_id) == 32 and int(own.trace_id, 16) != 0


def test_a_caller_that_does_not_sample_its_trace_gets_no_spans_and_a_sampled_ones_children_share_its_trace(
    traces: Tracing, receiver: OtlpReceiver
) -> None:
    """The caller's decision holds (``traceparent`` flags 00: not sampled), as the SDK's default sampler decides; a
    sampled request's children carry its trace, name it their parent and have ids of their own."""
    for request_id, flags in (("unsampled", "00"), ("sampled", "01")):
        trace = request(traces, request_id, {"traceparent": TRACEPARENT[:-2] + flags, "tracestate": "vendor=7"})
        marks, base = trace.generation(), trace.started
        marks.submitted, marks.queued, marks.started = base + 0.001, base + 0.002, base + 0.003
        marks.step(1, base + 0.004)
        marks.decoding, marks.decoded = base + 0.005, base + 0.006
        trace.end(200)
    root, children = sent(traces, receiver, request(traces, "last"), 200, 0)  # every span of the two sent before it is in
    assert not [s for s in receiver.spans if s.attributes.get("ldlm.request_id") == "unsampled"]
    root, children = receiver.request("sampled", 5, timeout_s=10)
    assert {(s.scope, s.trace_state) for s in [root, *children]} == {
        ("ldlm.serve.runtime.tracing", "vendor=7")
    }  # the caller's tracestate kept
    assert root.trace_id == TRACE_ID and {(c.trace_id, c.parent_id, c.kind) for c in children} == {(TRACE_ID, root.span_id, 1)}
    assert len({c.span_id for c in children} | {root.span_id, CALLER}) == 7  # SPAN_KIND_INTERNAL children, ids their own


def test_the_providers_sampler_is_asked_once_per_request_with_its_trace_name_kind_and_attributes(receiver: OtlpReceiver) -> None:
    """A sampler set on the provider (as ``OTEL_TRACES_SAMPLER`` sets one) decides for the request's span, told what the
    SDK's tracer would tell it; its children follow without asking again."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Sampler

    asked: list[tuple[Any, ...]] = []

    class Recording(Sampler):
        def should_sample(self, parent: Any, trace_id: int, name: str, kind: Any = None, attributes: Any = None, *rest: Any) -> Any:
            asked.append((trace_id, name, kind, dict(attributes or {})))
            return ALWAYS_ON.should_sample(parent, trace_id, name, kind, attributes)

        def get_description(self) -> str:
            return "recording"

    provider = TracerProvider(sampler=Recording())
    processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True))
    provider.add_span_processor(processor)
    traces = Tracing(provider, processor)
    try:
        trace = request(traces, "asked")
        marks, base = trace.generation(), trace.started
        marks.submitted, marks.queued = base + 0.001, base + 0.002
        root, _ = sent(traces, receiver, trace, 200, 1)
    finally:
        traces.close()
    assert asked == [(int(root.trace_id, 16), "POST /v1/generate", tracing.trace.SpanKind.SERVER, {**root.attributes})]
    assert root.scope == "ldlm.serve.runtime.tracing"  # the instrumentation scope each span is sent under


def test_marks_become_unix_nanoseconds_exactly(traces: Tracing, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mark's time is the wall clock at the trace's start plus the perf_counter seconds since, to the nanosecond."""
    monkeypatch.setattr(tracing.time, "perf_counter", lambda: 1_000_000.0)
    monkeypatch.setattr(tracing.time, "time_ns", lambda: 1_700_000_000_000_000_000)
    trace = request(traces, "clock")
    assert trace.ns(trace.started) == 1_700_000_000_000_000_000
    assert trace.ns(trace.started + 0.25) == 1_700_000_000_250_000_000


def test_the_request_span_is_a_server_span_named_as_http_and_rpc_servers_name_theirs(traces: Tracing, receiver: OtlpReceiver) -> None:
    root, _ = sent(traces, receiver, traces.http_request("GET", "/v1/models", {}, "http-1", "ldlm"), 200, 0)
    assert (root.name, root.kind) == ("GET /v1/models", 2)  # SPAN_KIND_SERVER
    assert root.attributes == {
        "http.request.method": "GET",
        "http.route": "/v1/models",
        "ldlm.request_id": "http-1",
        "gen_ai.request.model": "ldlm",
        "ldlm.status": 200,
    }
    call = traces.rpc_request("/inference.GRPCInferenceService/ModelInfer", {"traceparent": TRACEPARENT}, "rpc-1", "encoder")
    root, _ = sent(traces, receiver, call, 200, 0)
    assert (root.name, root.parent_id) == ("inference.GRPCInferenceService/ModelInfer", CALLER)
    assert root.attributes == {
        "rpc.system": "grpc",
        "rpc.service": "inference.GRPCInferenceService",
        "rpc.method": "ModelInfer",
        "ldlm.request_id": "rpc-1",
        "gen_ai.request.model": "encoder",
        "ldlm.status": 200,
    }


def test_a_generation_is_five_children_in_order_at_its_marks(traces: Tracing, receiver: OtlpReceiver) -> None:
    before = time.time_ns()
    trace = request(traces, "gen", {"traceparent": TRACEPARENT})
    marks = trace.generation()
    marks.plan = dict(PLAN)
    base = trace.started
    marks.submitted, marks.queued, marks.started = base + 0.001, base + 0.002, base + 0.004
    marks.step(3, base + 0.005)
    marks.step(5, base + 0.006)
    marks.step(5, base + 0.008)
    marks.decoding, marks.decoded, trace.delivered = base + 0.009, base + 0.011, base + 0.012
    root, children = sent(traces, receiver, trace, 200, 5)
    assert before <= root.start_ns <= time.time_ns()
    assert [c.name for c in children] == ["ldlm.admission", "ldlm.queue", "ldlm.steps", "ldlm.decode", "ldlm.delivery"]
    assert {(c.trace_id, c.parent_id) for c in children} == {(TRACE_ID, root.span_id)}
    at = [ms for c in children for ms in ((c.start_ns - root.start_ns) / 1e6, (c.end_ns - root.start_ns) / 1e6)]
    assert at == pytest.approx([1, 2, 2, 4, 4, 8, 9, 11, 11, 12], abs=0.01)  # ms after the request's start
    assert children[2].attributes == {"ldlm.steps": 3, "ldlm.batch.sizes": [3, 5], "ldlm.batch.size.max": 5, "ldlm.batch.size.mean": 13 / 3}
    assert [c.attributes for c in children if c.name != "ldlm.steps"] == [{}] * 4
    assert root.attributes["ldlm.plan"] == '{"grid": "uniform", "sampler": "ddim", "steps": 4}'
    assert (root.attributes["gen_ai.request.choice.count"], root.attributes["gen_ai.request.max_tokens"]) == (2, 8)


def test_a_request_that_never_got_that_far_has_only_the_spans_it_reached(traces: Tracing, receiver: OtlpReceiver) -> None:
    trace = request(traces, "queued-only")
    marks = trace.generation()
    marks.queued = marks.submitted + 0.001  # queued, then cancelled before a slot
    root, children = sent(traces, receiver, trace, 499, 1)
    time.sleep(0.2)  # anything more would have come in the same export
    assert [c.name for c in receiver.spans if c.parent_id == root.span_id] == ["ldlm.admission"]
    assert "ldlm.plan" not in root.attributes and root.status == 0  # no plan marked; a client's leaving is no server error


def test_steps_without_a_slot_mark_are_not_drawn(traces: Tracing, receiver: OtlpReceiver) -> None:
    trace = request(traces, "stepped-unslotted")
    marks = trace.generation()
    marks.step(1, marks.submitted + 0.001)  # started left at 0
    root, _ = sent(traces, receiver, trace, 200, 0)
    time.sleep(0.2)
    assert [c.name for c in receiver.spans if c.parent_id == root.span_id] == []


def test_a_graph_request_is_queue_batch_compute_and_delivery(traces: Tracing, receiver: OtlpReceiver) -> None:
    trace = traces.http_request("POST", "/v2/models/{model}/infer", {}, "graph", "encoder")
    marks = trace.batch()
    base = marks.queued
    marks.ran(base + 0.001, base + 0.002, base + 0.004, 7)
    root, children = sent(traces, receiver, trace, 200, 4)
    assert [c.name for c in children] == ["ldlm.queue", "ldlm.batch", "ldlm.compute", "ldlm.delivery"]
    assert [c.attributes for c in children] == [{}, {"ldlm.batch.size": 7}, {}, {}]
    at = [ms for c in children[:3] for ms in ((c.start_ns - children[0].start_ns) / 1e6, (c.end_ns - children[0].start_ns) / 1e6)]
    assert at == pytest.approx([0, 1, 1, 2, 2, 4], abs=0.01)
    assert children[3].end_ns == root.end_ns  # nothing marked its delivery: it lasts to the request's end
    assert "gen_ai.operation.name" not in root.attributes


def test_previews_are_events_at_their_time_with_their_step(traces: Tracing, receiver: OtlpReceiver) -> None:
    trace = request(traces, "previews")
    trace.preview(3)
    trace.preview(6)
    root, _ = sent(traces, receiver, trace, 200, 0)
    assert [(name, attributes) for name, _, attributes in root.events] == [
        ("ldlm.preview", {"ldlm.step": 3}),
        ("ldlm.preview", {"ldlm.step": 6}),
    ]
    times = [at for _, at, _ in root.events]
    assert root.start_ns <= times[0] <= times[1] <= root.end_ns
    assert times[0] == trace.ns(trace.previews[0][0])


@pytest.mark.parametrize("status, error", [(200, 0), (404, 0), (499, 0), (500, 2), (503, 2)])
def test_a_server_error_sets_the_span_status(traces: Tracing, receiver: OtlpReceiver, status: int, error: int) -> None:
    root, _ = sent(traces, receiver, request(traces, f"status-{status}"), status, 0)
    assert (root.status, root.attributes["ldlm.status"]) == (error, status)


def test_what_the_route_set_wins_over_what_the_generations_tell(traces: Tracing, receiver: OtlpReceiver) -> None:
    trace = request(traces, "usage")
    trace.generation().plan = dict(PLAN)
    trace.attributes["gen_ai.usage.output_tokens"] = 5
    root, _ = sent(traces, receiver, trace, 200, 0)
    assert root.attributes["gen_ai.usage.output_tokens"] == 5
    assert root.attributes["gen_ai.request.choice.count"] == 2


def test_the_generations_of_a_request_add_up() -> None:
    one, two, three, none = GenerationMarks(), GenerationMarks(), GenerationMarks(), GenerationMarks()
    one.plan = {**PLAN, "n": 2, "length": 8}
    two.plan = {**PLAN, "n": 3, "length": 12, "sampler": "euler"}  # the longest, neither first nor last
    three.plan = {**PLAN, "n": 1, "length": 4}
    assert generation_attributes([none]) == {}
    assert generation_attributes([none, one, two, three]) == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.choice.count": 6,
        "gen_ai.request.max_tokens": 12,
        "ldlm.plan": '{"grid": "uniform", "sampler": "ddim", "steps": 4}',  # the first's
        "gen_ai.usage.output_tokens": 2 * 8 + 3 * 12 + 1 * 4,
    }


def test_marks_count_steps_and_batch_sizes() -> None:
    marks = GenerationMarks()
    marks.step(4, 1.5)
    marks.step(2, 2.5)
    marks.step(4, 3.5)
    assert (marks.steps, marks.last_step, marks.batch_sizes) == (3, 3.5, {4: 2, 2: 1})
    assert steps_attributes(marks) == {
        "ldlm.steps": 3,
        "ldlm.batch.sizes": [2, 4],
        "ldlm.batch.size.max": 4,
        "ldlm.batch.size.mean": 10 / 3,
    }
    batch = BatchMarks()
    batch.ran(1.0, 2.0, 3.0, 9)
    assert (batch.taken, batch.assembled, batch.computed, batch.size) == (1.0, 2.0, 3.0, 9)
    assert 0 < GenerationMarks().submitted <= time.perf_counter() and 0 < BatchMarks().queued <= time.perf_counter()


def test_no_request_is_traced_unless_one_is_set() -> None:
    assert CURRENT.get() is None
    assert tracing.SERVICE_NAME == "ldlm"
