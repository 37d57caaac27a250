"""Admission by cost and fair order over HTTP, against the real server on 127.0.0.1: a short request
is answered while long ones hold the batch; requests that cannot meet their deadline (the server's
or their own ``timeout_s``) are refused at once (413 alone, 503 + Retry-After behind queued work),
naming the estimate and the limit. Step times are measured by the test with its own clock, and the
deadlines set from them with factors of 2 to spare."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")

from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from ldlm.serve.runtime.scheduler import GenerateRequest  # noqa: E402
from tests.serve.api.test_server_values import metric  # noqa: E402
from tests.servers import RunningServer, free_port  # noqa: E402

LENGTH = 64


@pytest.fixture(scope="module")
def server(export_dir: Path):
    settings = ServerSettings(port=free_port(), max_batch=4, request_timeout_s=300, max_n=16, max_steps=1000)
    running = RunningServer(LDLMService(str(export_dir), settings))
    yield running
    running.stop()


def full_batch_step_s(server: RunningServer) -> float:
    """Seconds of one step of a full batch (4 samples), by the test's clock: 100 steps of n=4."""
    started = time.perf_counter()
    response = httpx.post(f"{server.url}/v1/generate", json={"n": 4, "length": LENGTH, "steps": 100, "sampler": "ddim"}, timeout=300)
    assert response.status_code == 200, response.text
    return (time.perf_counter() - started) / 100


def test_a_short_request_is_answered_while_long_ones_hold_the_batch(server: RunningServer) -> None:
    service = server.service
    longs = [service.submit_generation(GenerateRequest(4, LENGTH, 1000, seed, "ddim")) for seed in (1, 2)]  # 8 samples, 4 slots
    try:
        deadline = time.time() + 30
        while service.scheduler.active_samples < 4:
            assert time.time() < deadline
            time.sleep(0.01)
        response = httpx.post(f"{server.url}/v1/generate", json={"n": 1, "length": LENGTH, "steps": 4, "sampler": "ddim"}, timeout=300)
        assert response.status_code == 200
        assert not any(f.done() for f in longs), "the short request waited for a long one to finish"
    finally:
        for future in longs:
            future.cancel()


def test_requests_past_their_deadline_are_refused_up_front_naming_the_estimate(server: RunningServer) -> None:
    step = full_batch_step_s(server)  # also gives the server's cost model its measurements
    url = server.url
    before = httpx.get(f"{url}/metrics", timeout=30).text
    # alone: 16 samples x 1000 steps is 4 chunks x 1000 full-batch steps, far beyond a 10-step deadline
    started = time.perf_counter()
    too_large = httpx.post(f"{url}/v1/generate", json={"n": 16, "length": LENGTH, "steps": 1000, "timeout_s": 10 * step}, timeout=300)
    assert too_large.status_code == 413, too_large.text
    assert time.perf_counter() - started < 200 * step  # refused at once, not after running
    assert too_large.json()["error"].startswith("this request (16 samples x 1000 steps at length 64) is estimated at ")
    assert f"even on an idle server, and its deadline is {10 * step:.1f} s" in too_large.json()["error"]

    # behind queued work: 4 requests of 4 x 200 steps (800 full-batch steps in all) wait ahead of one of 4 x 300
    ahead = [server.service.submit_generation(GenerateRequest(4, LENGTH, 200, seed, "ddim")) for seed in range(4)]
    try:
        own, queued = 300 * step, 800 * step  # a deadline that fits alone (1.8x to spare) but not behind them (2x short)
        timeout = (own + queued) / 2
        late = httpx.post(f"{url}/v1/generate", json={"n": 4, "length": LENGTH, "steps": 300, "timeout_s": timeout}, timeout=300)
        assert late.status_code == 503, late.text
        assert int(late.headers["retry-after"]) >= 1
        assert (
            "s of work queued ahead of it + " in late.json()["error"] and f"beyond its deadline of {timeout:.1f} s" in late.json()["error"]
        )
        fits = httpx.post(
            f"{url}/v1/completions",
            json={"model": "ldlm", "max_tokens": LENGTH, "n": 4, "steps": 300, "sampler": "ddim", "timeout_s": 2 * (own + queued)},
            timeout=300,
        )
        assert fits.status_code == 200, fits.text
    finally:
        for future in ahead:
            future.cancel()
    after = httpx.get(f"{url}/metrics", timeout=30).text
    for reason in ("too_large", "deadline"):
        assert (
            metric(after, "ldlm_request_refused_total", model="generate", reason=reason)
            == metric(before, "ldlm_request_refused_total", model="generate", reason=reason) + 1
        )
    assert metric(after, "ldlm_generate_sample_steps_per_second", bucket=str(LENGTH)) > 0


def test_a_timeout_above_the_servers_is_refused(server: RunningServer) -> None:
    response = httpx.post(f"{server.url}/v1/generate", json={"timeout_s": 301}, timeout=30)
    assert response.status_code == 422
    assert response.json() == {"error": "timeout_s: 301 is out of range; allowed: a number in (0, 300]"}
