"""Traces of every path that generates, and of the graph routes, received over OTLP/gRPC by a real receiver
(scripts/harness/otlp_receiver.py) from the real server tracing to it: /v1/generate (plain and streamed), /v1/completions
(plain and streamed), KServe infer over HTTP and gRPC (a graph, and ldlm_generate) and gRPC's ModelStreamInfer. Each
request's span is a child of the caller's traceparent (else a trace's root), carries the request id the answer
names, its route, model, plan, n, length and status; under it, its stages in order, and its previews as events.
The time to the first preview is in /metrics, per route."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the OpenTelemetry SDK (pip install -e .[otel] or .[test])")
pytest.importorskip("opentelemetry.proto", reason="the receiver's protocol definitions (pip install -e .[test])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient's gRPC client")

from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from scripts.harness.otlp_receiver import OtlpReceiver, ReceivedSpan  # noqa: E402
from scripts.harness.traffic import sse_events  # noqa: E402
from tests.serve.api.test_grpc_generate import scalar  # noqa: E402
from tests.serve.api.test_server_values import metric  # noqa: E402
from tests.servers import RunningServer, free_port, infer_body  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER}-01"
GENERATION = ["ldlm.admission", "ldlm.queue", "ldlm.steps", "ldlm.decode", "ldlm.delivery"]
GRAPH = ["ldlm.queue", "ldlm.batch", "ldlm.compute", "ldlm.delivery"]
GRPC = "inference.GRPCInferenceService"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def served(tiny_checkpoint: Path, receiver: OtlpReceiver) -> Iterator[RunningServer]:
    """The tiny checkpoint on the eager backend (no export to wait for: what is traced is the same on every backend)."""
    grpc_port = free_port()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # export within ms, not the default 5 s
        settings = ServerSettings(
            port=free_port(), grpc_port=grpc_port, backend="eager", max_steps=200, otlp_traces_endpoint=receiver.endpoint
        )
        running = RunningServer(LDLMService(str(tiny_checkpoint), settings))
    running.grpc_url = f"127.0.0.1:{grpc_port}"  # type: ignore[attr-defined]
    yield running
    running.stop()


def check_generation(root: ReceivedSpan, children: list[ReceivedSpan], steps: int, samples: int, delivered: bool = True) -> None:
    """A generation's five stages in order, one after another, within the request's span; its steps in one span.
    ``delivered``: its transport marks when the answer's last byte went (a gRPC unary call's answer goes after the handler)."""
    assert [c.name for c in children] == GENERATION
    assert all(root.start_ns <= c.start_ns <= c.end_ns <= root.end_ns for c in children)
    admission, queued, stepping, decode, delivery = children
    assert (admission.end_ns, queued.end_ns, decode.end_ns) == (queued.start_ns, stepping.start_ns, delivery.start_ns)  # one mark each
    assert stepping.end_ns <= decode.start_ns  # then the answers' thread takes it up
    assert (delivery.end_ns < root.end_ns) == delivered
    assert children[2].attributes == {
        "ldlm.steps": steps,
        "ldlm.batch.sizes": [samples],
        "ldlm.batch.size.max": samples,
        "ldlm.batch.size.mean": float(samples),
    }


def check_request(root: ReceivedSpan, request_id: str, model: str, status: int = 200, parent: str = CALLER) -> None:
    assert root.attributes["ldlm.request_id"] == request_id
    assert root.attributes["gen_ai.request.model"] == model
    assert root.attributes["ldlm.status"] == status
    assert root.parent_id == parent and (root.trace_id == TRACE_ID) == bool(parent)
    assert root.kind == 2  # SPAN_KIND_SERVER


def test_a_streamed_generation_over_http(served: RunningServer, receiver: OtlpReceiver) -> None:
    body = {"n": 2, "length": 10, "steps": 9, "sampler": "ddim", "stream": True, "preview_every": 3}
    headers = {"traceparent": TRACEPARENT, "x-request-id": "http-stream"}
    with httpx.stream("POST", f"{served.url}/v1/generate", json=body, headers=headers, timeout=60) as response:
        events = sse_events(response.iter_lines())
    assert response.headers["x-request-id"] == "http-stream"
    assert [name for name, _ in events] == ["preview", "preview", "result"]
    root, children = receiver.request("http-stream", 5)
    check_request(root, "http-stream", "ldlm")
    check_generation(root, children, 9, 2)
    assert (root.name, root.attributes["http.route"], root.attributes["http.response.status_code"]) == (
        "POST /v1/generate",
        "/v1/generate",
        200,
    )
    assert (root.attributes["gen_ai.request.choice.count"], root.attributes["gen_ai.request.max_tokens"]) == (2, 10)
    assert json.loads(root.attributes["ldlm.plan"]) == {k: v for k, v in events[-1][1]["plan"].items()}
    assert [(name, attributes) for name, _, attributes in root.events] == [
        ("ldlm.preview", {"ldlm.step": 3}),
        ("ldlm.preview", {"ldlm.step": 6}),
    ]
    assert all(
        children[2].start_ns <= at <= children[4].end_ns for _, at, _ in root.events
    )  # sent after steps began, before the answer went
    text = httpx.get(f"{served.url}/metrics").text
    assert metric(text, "ldlm_time_to_first_preview_seconds_count", route="/v1/generate") >= 1
    assert 0 < metric(text, "ldlm_time_to_first_preview_seconds_sum", route="/v1/generate") < (root.end_ns - root.start_ns) / 1e9


def test_a_plain_generation_without_traceparent_starts_a_trace(served: RunningServer, receiver: OtlpReceiver) -> None:
    response = httpx.post(f"{served.url}/v1/generate", json={"n": 3, "length": 8, "steps": 4}, timeout=60)
    request_id = response.headers["x-request-id"]  # the service's own id: the span names it, as the log line does
    root, children = receiver.request(request_id, 5)
    check_request(root, request_id, "ldlm", parent="")
    check_generation(root, children, 4, 3)
    assert root.events == []


def test_completions_plain_and_streamed(served: RunningServer, receiver: OtlpReceiver) -> None:
    body = {"model": "ldlm", "prompt": "It is a truth", "max_tokens": 6, "n": 2, "steps": 4}
    answer = httpx.post(f"{served.url}/v1/completions", json=body, headers={"x-request-id": "cmpl"}, timeout=60).json()
    root, children = receiver.request("cmpl", 5)
    check_request(root, "cmpl", "ldlm", parent="")
    check_generation(root, children, 4, 2)
    assert root.attributes["gen_ai.response.id"] == answer["id"]
    usage = answer["usage"]
    assert (root.attributes["gen_ai.usage.input_tokens"], root.attributes["gen_ai.usage.output_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert root.attributes["gen_ai.request.max_tokens"] == usage["prompt_tokens"] + 6  # the length that ran
    streamed = {**body, "prompt": ["It is a truth", "Emma"], "stream": True, "stream_options": {"include_usage": True}}
    headers = {"traceparent": TRACEPARENT, "x-request-id": "cmpl-stream"}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=streamed, headers=headers, timeout=60) as response:
        chunks = [data for _, data in sse_events(response.iter_lines()) if data != "[DONE]"]
    root, children = receiver.request("cmpl-stream", 10)
    check_request(root, "cmpl-stream", "ldlm")
    assert sorted(c.name for c in children) == sorted(GENERATION * 2)  # one generation per prompt
    assert root.attributes["gen_ai.request.choice.count"] == 4
    assert root.attributes["gen_ai.usage.output_tokens"] == chunks[-1]["usage"]["completion_tokens"]


def test_a_graph_infer_over_http(served: RunningServer, receiver: OtlpReceiver) -> None:
    headers = {"traceparent": TRACEPARENT, "x-request-id": "graph-http"}
    response = httpx.post(f"{served.url}/v2/models/encoder/versions/1/infer", json=infer_body(), headers=headers, timeout=60)
    assert response.status_code == 200
    root, children = receiver.request("graph-http", 4)
    check_request(root, "graph-http", "encoder")
    assert root.name == "POST /v2/models/{model}/versions/{version}/infer"
    assert root.attributes["http.route"] == "/v2/models/{model}/versions/{version}/infer"
    assert [c.name for c in children] == GRAPH
    assert [c.attributes for c in children] == [{}, {"ldlm.batch.size": 1}, {}, {}]
    assert all(a.end_ns == b.start_ns for a, b in zip(children, children[1:]))
    assert "ldlm.plan" not in root.attributes


def test_ldlm_generate_infer_over_http(served: RunningServer, receiver: OtlpReceiver) -> None:
    inputs = [
        {"name": "N", "shape": [1], "datatype": "INT64", "data": [2]},
        {"name": "LENGTH", "shape": [1], "datatype": "INT64", "data": [6]},
    ]
    inputs.append({"name": "STEPS", "shape": [1], "datatype": "INT64", "data": [3]})
    response = httpx.post(
        f"{served.url}/v2/models/ldlm_generate/infer", json={"inputs": inputs}, headers={"x-request-id": "gen-http"}, timeout=60
    )
    assert response.status_code == 200
    root, children = receiver.request("gen-http", 5)
    check_request(root, "gen-http", "ldlm_generate", parent="")
    assert root.attributes["http.route"] == "/v2/models/{model}/infer"
    check_generation(root, children, 3, 2)


def grpc_client(served: RunningServer) -> Any:
    return grpcclient.InferenceServerClient(served.grpc_url)  # type: ignore[attr-defined]


def test_infer_over_grpc(served: RunningServer, receiver: OtlpReceiver) -> None:
    client = grpc_client(served)
    ids = grpcclient.InferInput("input_ids", [1, 3], "INT64")
    ids.set_data_from_numpy(np.array([[1, 2, 3]], dtype=np.int64))
    mask = grpcclient.InferInput("attention_mask", [1, 3], "INT64")
    mask.set_data_from_numpy(np.ones((1, 3), dtype=np.int64))
    client.infer("encoder", [ids, mask], headers={"traceparent": TRACEPARENT, "x-request-id": "graph-grpc"})
    root, children = receiver.request("graph-grpc", 4)
    check_request(root, "graph-grpc", "encoder")
    assert (root.name, root.attributes["rpc.method"], root.attributes["rpc.grpc.status_code"]) == (f"{GRPC}/ModelInfer", "ModelInfer", 0)
    assert [c.name for c in children] == GRAPH
    client.infer("ldlm_generate", [scalar("N", 1), scalar("LENGTH", 6), scalar("STEPS", 3)], headers={"x-request-id": "gen-grpc"})
    root, children = receiver.request("gen-grpc", 5)
    check_request(root, "gen-grpc", "ldlm_generate", parent="")
    check_generation(root, children, 3, 1, delivered=False)
    with pytest.raises(Exception, match="N=0 is out of range"):
        client.infer("ldlm_generate", [scalar("N", 0), scalar("LENGTH", 6)], headers={"x-request-id": "bad-grpc"})
    root, children = receiver.request("bad-grpc", 0)
    check_request(root, "bad-grpc", "ldlm_generate", status=400, parent="")
    assert root.attributes["rpc.grpc.status_code"] == 3  # INVALID_ARGUMENT
    client.close()


def test_a_stream_over_grpc(served: RunningServer, receiver: OtlpReceiver) -> None:
    client = grpc_client(served)
    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)), headers={"traceparent": TRACEPARENT})
    parameters = {"preview_every": 2}
    client.async_stream_infer(
        "ldlm_generate", [scalar("N", 2), scalar("LENGTH", 6), scalar("STEPS", 5)], request_id="s1", parameters=parameters
    )
    responses = [answers.get(timeout=60) for _ in range(3)]  # previews of steps 2 and 4, then the result
    client.stop_stream()
    client.close()
    assert [error for _, error in responses] == [None] * 3
    root, children = receiver.request("s1", 5)
    check_request(root, "s1", "ldlm_generate")
    assert (root.name, root.attributes["rpc.method"]) == (f"{GRPC}/ModelStreamInfer", "ModelStreamInfer")
    assert "rpc.grpc.status_code" not in root.attributes  # one request of a stream: its error would be in-band
    check_generation(root, children, 5, 2)
    assert [attributes["ldlm.step"] for _, _, attributes in root.events] == [2, 4]
    text = httpx.get(f"{served.url}/metrics").text
    assert metric(text, "ldlm_time_to_first_preview_seconds_count", route=f"/{GRPC}/ModelStreamInfer") == 1


def test_a_refused_request_is_its_span_alone(served: RunningServer, receiver: OtlpReceiver) -> None:
    response = httpx.post(f"{served.url}/v1/generate", json={"n": 1, "length": 4, "steps": 201}, headers={"x-request-id": "refused"})
    assert response.status_code == 422
    root, _ = receiver.request("refused", 0)
    check_request(root, "refused", "ldlm", status=422, parent="")
    assert root.status == 0 and "ldlm.plan" not in root.attributes  # a client's error is no server error


def test_the_steps_span_counts_the_steps_the_request_ran_and_the_batches_it_shared(served: RunningServer, receiver: OtlpReceiver) -> None:
    """Beside a long generation that steps before, during and after it: its own 4 steps, in batches of its sample
    alone or with the other's two."""
    from ldlm.sampling import GenerateRequest

    long = served.service.submit_generation(GenerateRequest(2, 8, 200, 0, "ddim"))
    try:
        response = httpx.post(
            f"{served.url}/v1/generate", json={"n": 1, "length": 8, "steps": 4}, headers={"x-request-id": "beside"}, timeout=60
        )
        assert response.status_code == 200 and not long.done()
    finally:
        long.cancel()
    _, children = receiver.request("beside", 5)
    stepping = children[2].attributes
    assert stepping["ldlm.steps"] == 4
    assert set(stepping["ldlm.batch.sizes"]) <= {1, 3} and stepping["ldlm.batch.size.max"] == max(stepping["ldlm.batch.sizes"])
