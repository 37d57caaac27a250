"""A 503 for work queued ahead tells the client when to come back: Retry-After is the cost model's
estimate of the work that runs before the request (the queued sample-steps at the measured price of
one sample-step in a full batch), rounded up to whole seconds. Through the real server on 127.0.0.1.

The server's scheduler is one that never starts, so what is queued stays queued and its cost model
holds only the step times this test feeds it: every estimate is a number computed here, and no
assertion depends on how fast this machine runs."""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")

from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from ldlm.serve.runtime.scheduler import GenerateRequest, GenerationScheduler  # noqa: E402
from tests.servers import RunningServer, free_port  # noqa: E402

LENGTH, MAX_BATCH = 64, 4
CALL_S, SAMPLE_S = 0.01, 0.02  # the step times fed to the cost model: CALL_S + SAMPLE_S * k for k samples
FULL_STEP_S = CALL_S + SAMPLE_S * MAX_BATCH  # one step of a full batch
SAMPLE_STEP_S = FULL_STEP_S / MAX_BATCH  # what one queued sample-step costs: queued work shares full batches
QUEUED = GenerateRequest(MAX_BATCH, LENGTH, 45, sampler="ddim")  # 180 sample-steps: less than LATE's, so it runs first
LATE = GenerateRequest(MAX_BATCH, LENGTH, 100, sampler="ddim")  # 100 full-batch steps alone: 9 s at FULL_STEP_S
DEADLINE_S = 15.0  # LATE fits it alone (9 s), not behind two or four QUEUED (8.1 s or 16.2 s more)


Held = tuple[RunningServer, GenerationScheduler, list[Future]]


@pytest.fixture(scope="module")
def held(export_dir: Path) -> Iterator[Held]:
    """The server, its scheduler (one whose worker is not started, its cost model seeded), and what the test queued in it."""
    settings = ServerSettings(port=free_port(), max_batch=MAX_BATCH, request_timeout_s=300, max_n=16, max_steps=1000)
    service = LDLMService(str(export_dir), settings)
    service.scheduler.close()  # nothing was submitted to it
    scheduler = GenerationScheduler(service.scheduler.pipeline, MAX_BATCH, start=False)
    service.scheduler = scheduler
    bucket = scheduler.pipeline.bucket_length(LENGTH)
    for _ in range(4):  # two batch sizes, so that the fit sees the per-call and the per-sample cost apart
        for k in (1, MAX_BATCH):
            scheduler.cost.observe(bucket, k, CALL_S + SAMPLE_S * k)
    running = RunningServer(service)
    queued: list[Future] = []
    yield running, scheduler, queued
    for future in queued:
        future.cancel()
    scheduler.start()  # it drops the cancelled work, and stops when the server's shutdown closes the service
    running.stop()


def test_retry_after_is_the_queued_work_at_the_measured_step_cost_rounded_up(held: Held) -> None:
    server, scheduler, queued = held
    body = {"n": LATE.n, "length": LATE.length, "steps": LATE.steps, "sampler": LATE.sampler, "timeout_s": DEADLINE_S}
    for count in (2, 4):
        while len(queued) < count:
            queued.append(scheduler.submit(QUEUED))
        ahead_s = count * QUEUED.n * QUEUED.steps * SAMPLE_STEP_S  # 8.1 s, then 16.2 s
        # the scheduler's own estimate agrees with the count here, so a wrong header is the refusal's fault
        assert scheduler.estimate_s(LATE) == pytest.approx((ahead_s, LATE.steps * FULL_STEP_S))
        late = httpx.post(f"{server.url}/v1/generate", json=body, timeout=60)
        assert late.status_code == 503, late.text
        assert late.headers["retry-after"] == str(math.ceil(ahead_s))  # 9, then 17: rounded up, not to the nearest
        assert f"retry in {math.ceil(ahead_s)} s" in late.json()["error"]
