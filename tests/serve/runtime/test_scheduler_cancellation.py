"""Work for a client that is gone is not done: a generation (plain or streamed) whose client
disconnected or whose deadline passed leaves the batch at the next step, and a /v2 graph request
cancelled while it waits for company leaves the dynamic batcher's queue before it runs. Real
clients (httpx) against the real server on 127.0.0.1; what is checked is the scheduler's and the
batcher's own counts of work done, and the metrics. A client leaves once the server holds its request
(a raw connection, closed when the test has seen the work start), not after a client timeout, which
on a loaded machine can pass before the server has read the request at all; the waits are liveness
bounds (60 s), never the assertion."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")

from ldlm.limits import MAX_TIMEOUT_S  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from ldlm.serve.runtime.scheduler import GenerationScheduler  # noqa: E402
from tests.serve.api.test_server_values import metric, wait_for_company  # noqa: E402
from tests.servers import RunningServer, free_port, infer_body  # noqa: E402

LONG = {"n": 64, "length": 128, "steps": 1000, "seed": 0, "sampler": "ddim"}  # 64,000 sample-steps: tens of seconds here
SHORT = {"n": 1, "length": 8, "steps": 2, "seed": 1, "sampler": "ddim"}


@pytest.fixture(scope="module")
def server(export_dir: Path):
    # The long ones fit, and their deadline is the longest a server takes: on a loaded machine the cost model prices
    # LONG at thousands of seconds (2,449 s seen at load 6) and a shorter deadline refuses it up front (413), which
    # is right, but leaves these tests nothing queued to cancel.
    settings = ServerSettings(port=free_port(), max_batch=16, request_timeout_s=MAX_TIMEOUT_S, max_n=64, max_steps=1000)
    running = RunningServer(LDLMService(str(export_dir), settings))
    yield running
    running.stop()


def wait_until(condition, timeout_s: float, what: str) -> float:
    """Seconds until ``condition()`` holds (polled), or an assertion naming ``what``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"{what} did not happen within {timeout_s:g} s"
        time.sleep(0.01)
    return time.monotonic() - started


@contextlib.contextmanager
def client_that_leaves(url: str, path: str, body: dict) -> Iterator[None]:
    """A client that sends its request, stays connected through the block, then closes its connection
    without reading the answer."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(head.encode() + data)
        yield


def idle(scheduler: GenerationScheduler) -> bool:
    return not scheduler._active and scheduler.queued_samples == 0


def metrics(server: RunningServer) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=30).text


def test_a_plain_generation_whose_client_left_frees_its_slots(server: RunningServer) -> None:
    scheduler = server.service.scheduler
    assert idle(scheduler)
    before = metric(metrics(server), "ldlm_request_cancelled_total", model="generate", reason="disconnect")
    stepped = scheduler.samples_stepped
    with client_that_leaves(server.url, "/v1/generate", LONG):  # it leaves once its generation has started
        wait_until(lambda: scheduler.samples_stepped > stepped, 60, "the long generation starting")
    wait_until(lambda: idle(scheduler), 60, "the abandoned generation leaving the batch")
    done_for_nobody = scheduler.samples_stepped - stepped
    assert 0 < done_for_nobody < LONG["n"] * LONG["steps"] // 4, done_for_nobody  # it started, and stopped long before its end
    answer = httpx.post(f"{server.url}/v1/generate", json=SHORT, timeout=60)
    assert answer.status_code == 200, answer.text
    # the slots were free, so the short one did not wait behind the abandoned one: only its own 2 steps ran
    # since (none of the 64 x 1000)
    assert scheduler.samples_stepped - stepped - done_for_nobody == SHORT["n"] * SHORT["steps"]
    assert metric(metrics(server), "ldlm_request_cancelled_total", model="generate", reason="disconnect") == before + 1


def test_a_generation_past_its_deadline_frees_its_slots(export_dir: Path) -> None:
    settings = ServerSettings(port=free_port(), max_batch=16, request_timeout_s=1, max_n=64, max_steps=1000)
    running = RunningServer(LDLMService(str(export_dir), settings))
    try:
        scheduler = running.service.scheduler
        before = scheduler.samples_stepped
        response = httpx.post(f"{running.url}/v1/generate", json=LONG, timeout=600)
        assert response.status_code == 504 and "timed out after 1 s" in response.json()["error"]
        stepped = scheduler.samples_stepped
        assert stepped - before < LONG["n"] * LONG["steps"]  # answered at its deadline, not after running to its end
        wait_until(lambda: idle(scheduler), 60, "the timed-out generation leaving the batch")
        assert scheduler.samples_stepped - stepped <= settings.max_batch  # at most the one step under way
        assert httpx.post(f"{running.url}/v1/generate", json=SHORT, timeout=60).status_code == 200
        assert metric(metrics(running), "ldlm_request_cancelled_total", model="generate", reason="timeout") == 1
    finally:
        running.stop()


def test_a_completion_whose_client_left_frees_its_slots(server: RunningServer) -> None:
    scheduler = server.service.scheduler
    body = {"model": "ldlm", "prompt": ["", ""], "max_tokens": 128, "n": 32, "steps": 1000, "sampler": "ddim"}
    stepped = scheduler.samples_stepped
    with client_that_leaves(server.url, "/v1/completions", body):  # it leaves once its completion has started
        wait_until(lambda: scheduler.samples_stepped > stepped, 60, "the long completion starting")
    wait_until(lambda: idle(scheduler), 60, "the abandoned completion leaving the batch")
    done_for_nobody = scheduler.samples_stepped - stepped
    assert 0 < done_for_nobody < body["n"] * body["steps"] // 4, done_for_nobody


def test_a_client_that_leaves_while_its_request_is_being_queued_leaves_nothing_queued(server: RunningServer, monkeypatch) -> None:
    """The client is gone before submit() returns (it runs in a thread): what it queued is cancelled when it returns."""
    scheduler = server.service.scheduler
    entered, release = threading.Event(), threading.Event()
    queued: list[Future] = []

    refused: list[BaseException] = []

    def slow_submit(*args, **kwargs):
        entered.set()
        release.wait(60)
        try:
            queued.append(GenerationScheduler.submit(scheduler, *args, **kwargs))
        except BaseException as error:  # noqa: BLE001 (recorded for the assertion below)
            refused.append(error)
            raise
        return queued[-1]

    monkeypatch.setattr(scheduler, "submit", slow_submit)
    before = metric(metrics(server), "ldlm_request_cancelled_total", model="generate", reason="disconnect")
    with client_that_leaves(server.url, "/v1/generate", LONG):  # it leaves while submit() is under way
        assert entered.wait(60), "the request never reached submit()"
    wait_until(
        lambda: metric(metrics(server), "ldlm_request_cancelled_total", model="generate", reason="disconnect") == before + 1,
        60,
        "the server noticing the disconnect",
    )
    release.set()
    wait_until(lambda: bool(queued) and queued[0].cancelled() or bool(refused), 60, "the late-queued request being cancelled")
    assert not refused, f"submit refused the request, so nothing was queued to cancel: {refused[0]!r}"
    wait_until(lambda: idle(scheduler), 60, "the late-queued samples leaving")


def test_a_graph_request_cancelled_while_it_waits_never_runs(export_dir: Path) -> None:
    """Batches of 2 with a 30 s window, at a batcher that is not idle: request A waits for company, its
    client leaves; B and C then fill one batch of their own (with A still queued, A and B would run and C
    would wait 30 s)."""
    settings = ServerSettings(port=free_port(), max_batch=2, max_delay_ms=30_000, request_timeout_s=60)
    running = RunningServer(LDLMService(str(export_dir), settings))
    try:
        batcher = running.service.batchers["encoder"]
        wait_for_company(batcher)
        with client_that_leaves(running.url, "/v2/models/encoder/infer", infer_body()):  # it leaves once A is queued
            wait_until(lambda: batcher.queued == 1, 60, "request A waiting for company")
        wait_until(lambda: batcher.queued == 0, 60, "the abandoned request leaving the queue")
        wait_for_company(batcher)  # the worker, idle again, would run B at once
        answers: list[httpx.Response] = []
        threads = [
            threading.Thread(
                target=lambda: answers.append(httpx.post(f"{running.url}/v2/models/encoder/infer", json=infer_body(), timeout=60))
            )
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert [a.status_code for a in answers] == [200, 200]
        text = metrics(running)
        assert metric(text, "ldlm_execution_count_total", model="encoder") == 1
        assert metric(text, "ldlm_inference_count_total", model="encoder") == 2  # B and C; A's row never ran
        assert metric(text, "ldlm_cancelled_samples_total", model="encoder") == 1
        assert metric(text, "ldlm_request_cancelled_total", model="encoder", reason="disconnect") == 1
    finally:
        running.stop()
