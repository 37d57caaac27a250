"""Work for a client that is gone is not done: a generation (plain or streamed) whose client
disconnected or whose deadline passed leaves the batch at the next step, and a /v2 graph request
cancelled while it waits for company leaves the dynamic batcher's queue before it runs. Real
clients (httpx) against the real server on 127.0.0.1; what is checked is the scheduler's and the
batcher's own counts of work done, and the metrics."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")

from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from ldlm.serve.runtime.scheduler import GenerationScheduler  # noqa: E402
from tests.serve.api.test_server_values import metric  # noqa: E402
from tests.servers import RunningServer, free_port, infer_body  # noqa: E402

LONG = {"n": 64, "length": 128, "steps": 1000, "seed": 0, "sampler": "ddim"}  # 64,000 sample-steps: tens of seconds here
SHORT = {"n": 1, "length": 8, "steps": 2, "seed": 1, "sampler": "ddim"}


@pytest.fixture(scope="module")
def server(export_dir: Path):
    settings = ServerSettings(port=free_port(), max_batch=16, request_timeout_s=600, max_n=64, max_steps=1000)  # the long ones fit
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


def idle(scheduler: GenerationScheduler) -> bool:
    return not scheduler._active and scheduler.queued_samples == 0


def metrics(server: RunningServer) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=30).text


def test_a_plain_generation_whose_client_left_frees_its_slots(server: RunningServer) -> None:
    scheduler = server.service.scheduler
    assert idle(scheduler)
    before = metric(metrics(server), "ldlm_request_cancelled_total", model="generate", reason="disconnect")
    stepped = scheduler.samples_stepped
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s and closes its connection
        httpx.post(f"{server.url}/v1/generate", json=LONG, timeout=1)
    wait_until(lambda: idle(scheduler), 10, "the abandoned generation leaving the batch")
    done_for_nobody = scheduler.samples_stepped - stepped
    assert 0 < done_for_nobody < LONG["n"] * LONG["steps"] // 4, done_for_nobody  # it started, and stopped long before its end
    started = time.monotonic()
    answer = httpx.post(f"{server.url}/v1/generate", json=SHORT, timeout=60)
    took = time.monotonic() - started
    assert answer.status_code == 200, answer.text
    # the slots were free: only the short request's own 2 steps ran since (none of the 64 x 1000)
    assert scheduler.samples_stepped - stepped - done_for_nobody == SHORT["n"] * SHORT["steps"]
    assert took < 5, f"the short request took {took:.1f} s"
    assert metric(metrics(server), "ldlm_request_cancelled_total", model="generate", reason="disconnect") == before + 1


def test_a_generation_past_its_deadline_frees_its_slots(export_dir: Path) -> None:
    settings = ServerSettings(port=free_port(), max_batch=16, request_timeout_s=1, max_n=64, max_steps=1000)
    running = RunningServer(LDLMService(str(export_dir), settings))
    try:
        scheduler = running.service.scheduler
        started = time.monotonic()
        response = httpx.post(f"{running.url}/v1/generate", json=LONG, timeout=60)
        assert response.status_code == 504 and "timed out after 1 s" in response.json()["error"]
        assert time.monotonic() - started < 10
        stepped = scheduler.samples_stepped
        wait_until(lambda: idle(scheduler), 10, "the timed-out generation leaving the batch")
        assert scheduler.samples_stepped - stepped <= settings.max_batch  # at most the one step under way
        assert httpx.post(f"{running.url}/v1/generate", json=SHORT, timeout=60).status_code == 200
        assert metric(metrics(running), "ldlm_request_cancelled_total", model="generate", reason="timeout") == 1
    finally:
        running.stop()


def test_a_completion_whose_client_left_frees_its_slots(server: RunningServer) -> None:
    scheduler = server.service.scheduler
    body = {"model": "ldlm", "prompt": ["", ""], "max_tokens": 128, "n": 32, "steps": 1000, "sampler": "ddim"}
    stepped = scheduler.samples_stepped
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1)
    wait_until(lambda: idle(scheduler), 10, "the abandoned completion leaving the batch")
    assert scheduler.samples_stepped - stepped < 64 * 1000 // 4


def test_a_client_that_leaves_while_its_request_is_being_queued_leaves_nothing_queued(server: RunningServer, monkeypatch) -> None:
    """The client is gone before submit() returns (it runs in a thread): what it queued is cancelled when it returns."""
    scheduler = server.service.scheduler
    release = threading.Event()
    queued: list[Future] = []

    def slow_submit(*args, **kwargs):
        release.wait(30)
        queued.append(GenerationScheduler.submit(scheduler, *args, **kwargs))
        return queued[-1]

    monkeypatch.setattr(scheduler, "submit", slow_submit)
    before = metric(metrics(server), "ldlm_request_cancelled_total", model="generate", reason="disconnect")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/generate", json=LONG, timeout=0.5)
    wait_until(
        lambda: metric(metrics(server), "ldlm_request_cancelled_total", model="generate", reason="disconnect") == before + 1,
        10,
        "the server noticing the disconnect",
    )
    release.set()
    wait_until(lambda: bool(queued) and queued[0].cancelled(), 10, "the late-queued request being cancelled")
    wait_until(lambda: idle(scheduler), 10, "the late-queued samples leaving")


def test_a_graph_request_cancelled_while_it_waits_never_runs(export_dir: Path) -> None:
    """Batches of 2 with a 30 s window: request A waits for company, its client leaves; B and C then
    fill one batch of their own (with A still queued, A and B would run and C would wait 30 s)."""
    settings = ServerSettings(port=free_port(), max_batch=2, max_delay_ms=30_000, request_timeout_s=60)
    running = RunningServer(LDLMService(str(export_dir), settings))
    try:
        batcher = running.service.batchers["encoder"]
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{running.url}/v2/models/encoder/infer", json=infer_body(), timeout=1)
        wait_until(lambda: batcher.queued == 0, 10, "the abandoned request leaving the queue")
        answers: list[httpx.Response] = []
        threads = [
            threading.Thread(
                target=lambda: answers.append(httpx.post(f"{running.url}/v2/models/encoder/infer", json=infer_body(), timeout=20))
            )
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert [a.status_code for a in answers] == [200, 200]
        text = metrics(running)
        assert metric(text, "ldlm_execution_count_total", model="encoder") == 1
        assert metric(text, "ldlm_inference_count_total", model="encoder") == 2  # B and C; A's row never ran
        assert metric(text, "ldlm_cancelled_samples_total", model="encoder") == 1
        assert metric(text, "ldlm_request_cancelled_total", model="encoder", reason="disconnect") == 1
    finally:
        running.stop()
