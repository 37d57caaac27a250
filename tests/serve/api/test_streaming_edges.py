"""The service's edges beside its main roads, against one real server on 127.0.0.1 (HTTP and gRPC):

- a stream whose tokens are drawn at a temperature or within a nucleus gets every preview due, each with its
  step, before its result, as an argmax one does (its result is decoded on its own, apart from the argmax ones);
- the previews of a stream naming no steps say the steps its plan resolved to;
- a gRPC ldlm_generate stream cancelled, an SSE stream closed and a plain /v1/generate client gone each free
  their samples' slots and queue places at once, read from the scheduler and from /metrics' gauges;
- the repository index of a server that is not ready (starting) lists its models UNAVAILABLE, and none when asked
  for the ready ones, over HTTP and gRPC.

Waits poll with a generous deadline; how much work ran is read from the scheduler's own counts, never timed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient's gRPC client (pip install -e .[test])")

import grpc  # noqa: E402
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402

from ldlm.limits import MAX_TIMEOUT_S  # noqa: E402
from ldlm.sampling import GenerateRequest  # noqa: E402
from ldlm.sampling.tokens import TokenSampling  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from ldlm.serve.api.streaming import GenerationStream  # noqa: E402
from ldlm.serve.runtime.scheduler import GenerationScheduler  # noqa: E402
from scripts.harness.traffic import sse_events  # noqa: E402
from tests.serve.api.test_grpc_generate import Stream  # noqa: E402
from tests.serve.api.test_server_values import metric  # noqa: E402
from tests.servers import RunningServer, free_port  # noqa: E402

MAX_BATCH = 4
# 8 samples x 2000 steps: half of them run, half wait for a slot, for far longer than any test here waits
LONG = {"n": 8, "length": 64, "steps": 2000, "seed": 0, "sampler": "ddim"}
LIVENESS_S = 120.0  # how long a wait may take before it is a failure: a bound, never the assertion


@pytest.fixture(scope="module")
def served(export_dir: Path) -> Iterator[RunningServer]:
    # The longest deadline a server takes: the cost model must not refuse LONG up front on a loaded machine.
    grpc_port = free_port()
    settings = ServerSettings(
        port=free_port(), grpc_port=grpc_port, max_batch=MAX_BATCH, max_n=16, max_steps=2000, request_timeout_s=MAX_TIMEOUT_S
    )
    running = RunningServer(LDLMService(str(export_dir), settings))
    running.grpc_url = f"127.0.0.1:{grpc_port}"  # type: ignore[attr-defined]
    yield running
    running.stop()


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = LIVENESS_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:g} s"
        time.sleep(0.01)


def metrics(served: RunningServer) -> str:
    return httpx.get(f"{served.url}/metrics", timeout=30).text


# --- previews of a stream whose tokens are drawn ----------------------------------------------------------


def held_until_answered(hook: Callable[[Any], None], scheduler: GenerationScheduler) -> Callable[[Any], None]:
    """``hook``, its first call holding the previews' thread until the request's last step is delivered (the
    scheduler no longer holds it) and the answers' thread has run what it was handed by then. A result that
    does not wait for its previews is out by the time the hold ends; one that waits is still behind them."""
    calls: list[int] = []

    def held(previews: Any) -> None:
        if not calls:
            wait_until(lambda: not scheduler._requests, "the generation's last step")
            scheduler.delivery._answers.submit(lambda: None).result(LIVENESS_S)  # one thread, in order: what came before ran
        calls.append(1)
        hook(previews)

    return held


async def stream_events(served: RunningServer, spec: GenerateRequest, every: int, decoding: TokenSampling) -> list[tuple[str, Any]]:
    """Every event of one stream (``GenerationStream``, as /v1/generate's and gRPC's streams run it), its request's
    tokens drawn by ``decoding``, its first preview held (``held_until_answered``)."""
    service = served.service

    def submit(spec: GenerateRequest, prefix: Any, hook: Any, every: int) -> Any:
        return service.submit_generation(spec, prefix, held_until_answered(hook, service.scheduler), every, decoding=decoding)

    loop = asyncio.get_running_loop()
    stream = GenerationStream(submit, service.pipeline.tokenizer, spec, every, loop=loop)
    return [event async for event in stream.events(LIVENESS_S)]


@pytest.mark.parametrize(
    "decoding",
    [TokenSampling(temperature=0.8, seed=3), TokenSampling(temperature=1.0, top_p=0.5, seed=3)],
    ids=["temperature", "top_p"],
)
def test_a_sampled_stream_gets_every_preview_before_its_result(served: RunningServer, decoding: TokenSampling) -> None:
    assert decoding.needs_logits  # its result is decoded from the logits, on its own
    spec = GenerateRequest(2, 8, 12, 1, "ddim")
    events = asyncio.run(stream_events(served, spec, 3, decoding))
    assert [kind for kind, _ in events] == ["preview"] * 3 + ["result"]
    shown = [[(p["index"], p["step"]) for p in previews] for _, previews in events[:-1]]
    assert shown == [[(0, step), (1, step)] for step in (3, 6, 9)]  # every 3 steps below the 12th, both samples
    result = events[-1][1]
    assert len(result.texts) == 2 and result.plan.steps == 12


# --- the steps a preview names -------------------------------------------------------------------------------


def default_steps(served: RunningServer, body: dict[str, Any]) -> int:
    """The steps a request naming none runs, as its answer's plan says."""
    answer = httpx.post(f"{served.url}/v1/generate", json=body, timeout=LIVENESS_S)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["plan"]["steps"])


def test_sse_previews_of_a_request_naming_no_steps_say_its_steps(served: RunningServer) -> None:
    body = {"n": 2, "length": 8, "seed": 4}
    steps = default_steps(served, body)
    every = max(1, steps // 3)
    with httpx.stream("POST", f"{served.url}/v1/generate", json={**body, "stream": True, "preview_every": every}, timeout=LIVENESS_S) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    previews = [data for kind, data in events if kind == "preview"]
    assert events[-1][0] == "result" and events[-1][1]["plan"]["steps"] == steps
    assert [p["samples"][0]["step"] for p in previews] == list(range(every, steps, every))
    assert previews and all(p["steps"] == steps for p in previews), previews


def test_grpc_previews_of_a_request_naming_no_steps_say_its_steps(served: RunningServer) -> None:
    steps = default_steps(served, {"n": 1, "length": 8, "seed": 4})
    every = max(1, steps // 3)
    stream = Stream(served, headers=None)
    try:
        stream.send("no-steps", preview_every=every, N=1, LENGTH=8, SEED=4)
        *previews, final = stream.until_final()
    finally:
        stream.client.stop_stream()
    assert json.loads(final.as_numpy("PLAN")[0])["steps"] == steps
    params = [p.get_response().parameters for p in previews]
    assert [p["step"].int64_param for p in params] == list(range(every, steps, every))
    assert params and all(p["steps"].int64_param == steps for p in params)


# --- a client gone frees its slots and queue places ------------------------------------------------------


def counts(served: RunningServer) -> tuple[int, int, float, float]:
    """(active, waiting) samples as the scheduler counts them, then as /metrics' gauges read them."""
    scheduler, text = served.service.scheduler, metrics(served)
    gauges = metric(text, "ldlm_generate_active_samples"), metric(text, "ldlm_queue_depth", model="generate")
    return scheduler.active_samples, scheduler.queued_samples, *gauges


@contextlib.contextmanager
def grpc_stream_cancelled(served: RunningServer) -> Iterator[None]:
    stream = Stream(served, headers=None)
    stream.send("long", preview_every=1, **{name.upper(): value for name, value in LONG.items()})
    try:
        yield
    finally:
        stream.client.stop_stream(cancel_requests=True)


@contextlib.contextmanager
def sse_stream_closed(served: RunningServer) -> Iterator[None]:
    body = {**LONG, "stream": True, "preview_every": 1}
    with httpx.stream("POST", f"{served.url}/v1/generate", json=body, timeout=LIVENESS_S) as response:
        assert response.status_code == 200, response.read()
        yield  # the response closed unread: its connection goes


@contextlib.contextmanager
def http_client_gone(served: RunningServer) -> Iterator[None]:
    """A raw connection that sends the request and closes without reading the answer."""
    data = json.dumps(LONG).encode()
    head = f"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", served.service.settings.port), timeout=LIVENESS_S) as connection:
        connection.sendall(head.encode() + data)
        yield


@pytest.mark.parametrize("leaving", [grpc_stream_cancelled, sse_stream_closed, http_client_gone], ids=["grpc", "sse", "http"])
def test_a_client_gone_frees_its_slots_and_queue_places(served: RunningServer, leaving: Callable[..., Any]) -> None:
    scheduler = served.service.scheduler
    wait_until(lambda: counts(served) == (0, 0, 0, 0), "an idle server")
    stepped = scheduler.samples_stepped
    running = (MAX_BATCH, LONG["n"] - MAX_BATCH)
    with leaving(served):
        wait_until(lambda: counts(served) == (*running, *running), "half the samples running, half waiting, on both counts")
    wait_until(lambda: counts(served) == (0, 0, 0, 0), "the slots and queue places freed")
    done_for_nobody = scheduler.samples_stepped - stepped
    # it started, and stopped long before its end: not a tenth of its sample-steps ran
    assert 0 < done_for_nobody < LONG["n"] * LONG["steps"] // 10, done_for_nobody
    wait_until(lambda: metric(metrics(served), "ldlm_generate_in_flight") == 0, "the request answered")


# --- the repository index of a server that is not ready ---------------------------------------------------


@contextlib.contextmanager
def not_ready(served: RunningServer) -> Iterator[None]:
    """The service as it is until its start ends (and again once it closes)."""
    served.service.ready = False
    try:
        yield
    finally:
        served.service.ready = True


def index_over_both(served: RunningServer, ready: bool | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The repository index over HTTP (POST /v2/repository/index) and over gRPC (RepositoryIndex); ``ready``: the
    filter sent (None: an empty body; gRPC's default, false)."""
    body = {} if ready is None else {"json": {"ready": ready}}
    answer = httpx.post(f"{served.url}/v2/repository/index", timeout=30, **body)
    assert answer.status_code == 200, answer.text
    with grpc.insecure_channel(served.grpc_url) as channel:  # type: ignore[attr-defined]
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        message = stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=bool(ready)), timeout=30)
    over_grpc = [{"name": m.name, "version": m.version, "state": m.state, "reason": m.reason} for m in message.models]
    return answer.json(), over_grpc


def test_the_repository_index_of_a_server_not_ready(served: RunningServer) -> None:
    models = [*served.service.graphs, "ldlm_generate"]

    def listed(state: str) -> list[dict[str, str]]:
        return [{"name": m, "version": "1", "state": state, "reason": ""} for m in models]

    with not_ready(served):
        for ready in (None, False):
            assert index_over_both(served, ready) == (listed("UNAVAILABLE"), listed("UNAVAILABLE"))
        assert index_over_both(served, True) == ([], [])  # none is ready yet
    for ready in (None, False, True):
        assert index_over_both(served, ready) == (listed("READY"), listed("READY"))
