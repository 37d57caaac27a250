"""Admission by cost and fair order over HTTP, against the real server on 127.0.0.1: a short request
is answered while long ones hold the batch; requests that cannot meet their deadline (the server's
or their own ``timeout_s``) are refused at once (413 alone, 503 + Retry-After behind queued work),
naming the estimate and the limit. The deadline case prices with a fixed step cost put in place of the
measured one, so what is refused does not depend on how fast the machine is at the moment (a step timed
by the test and the server's moving fit of later steps drift apart when other jobs share the CPU)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")

from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from ldlm.serve.runtime.cost import CostModel  # noqa: E402
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


class FixedStepCost(CostModel):
    """Prices every step of a full batch at ``step_s`` whatever the clock says, while still measuring (for
    /metrics) and counting the steps the executor reports."""

    def __init__(self, max_batch: int, step_s: float) -> None:
        super().__init__(max_batch)
        self.fixed_step_s, self.observed = step_s, 0

    def observe(self, bucket: int, samples: int, seconds: float) -> None:
        self.observed += 1
        super().observe(bucket, samples, seconds)

    def step_s(self, bucket: int, samples: int) -> float | None:
        return self.fixed_step_s

    def rates(self) -> dict[int, float]:
        measured = {b: CostModel.step_s(self, b, self.max_batch) for b in self._fits}
        return {b: self.max_batch / s for b, s in measured.items() if s}


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
    # 0.12 s a full-batch step: the longest deadline below (2 x 1100 steps) stays within the server's 300 s,
    # and is still far beyond what 1100 real steps of the tiny model take on a loaded machine
    step = 0.12
    service = server.service
    measured, service.scheduler.cost = service.scheduler.cost, FixedStepCost(4, step)
    try:
        refusals(server, step)
    finally:
        service.scheduler.cost = measured


def refusals(server: RunningServer, step: float) -> None:
    service, url, cost = server.service, server.url, server.service.scheduler.cost
    assert isinstance(cost, FixedStepCost)
    before = httpx.get(f"{url}/metrics", timeout=30).text
    # alone: 16 samples x 1000 steps is 4 chunks x 1000 full-batch steps, far beyond a 10-step deadline
    steps_before = cost.observed
    too_large = httpx.post(f"{url}/v1/generate", json={"n": 16, "length": LENGTH, "steps": 1000, "timeout_s": 10 * step}, timeout=300)
    assert too_large.status_code == 413, too_large.text
    assert cost.observed == steps_before  # refused at once: not one step ran before the answer
    assert too_large.json()["error"].startswith("this request (16 samples x 1000 steps at length 64) is estimated at ")
    assert f"even on an idle server, and its deadline is {10 * step:.1f} s" in too_large.json()["error"]

    # behind queued work: 4 requests of 4 x 200 steps (800 full-batch steps in all) wait ahead of one of 4 x 300
    ahead = [service.submit_generation(GenerateRequest(4, LENGTH, 200, seed, "ddim")) for seed in range(4)]
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
