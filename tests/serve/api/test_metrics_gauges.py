"""/metrics reads the queues, the running batch and the generations in flight when scraped: nonzero while work
runs, zero once it is done or cancelled (how a soak checks that nothing was left behind)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")

from ldlm.sampling import GenerateRequest  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402


def gauges(service: LDLMService) -> dict[str, float]:
    out = {}
    for line in service.metrics.render().decode().splitlines():
        if line.startswith(("ldlm_queue_depth{", "ldlm_generate_active_samples ", "ldlm_generate_in_flight ")):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_work_shows_while_it_runs_and_nothing_is_left_after(export_dir: Path) -> None:
    service = LDLMService(str(export_dir), ServerSettings(max_batch=2, max_steps=100_000))
    future = None
    try:
        assert set(gauges(service).values()) == {0.0}
        future = service.submit_generation(GenerateRequest(4, 8, 100_000, 0, "ddim"))  # 2 running, 2 queued
        deadline = time.monotonic() + 60
        while gauges(service)["ldlm_generate_active_samples"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        busy = gauges(service)
        assert busy["ldlm_generate_active_samples"] == 2 and busy['ldlm_queue_depth{model="generate"}'] == 2, busy
        assert busy["ldlm_generate_in_flight"] == 1
        future.cancel()
        while any(gauges(service).values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert set(gauges(service).values()) == {0.0}, gauges(service)
    finally:
        if future is not None:
            future.cancel()  # a failed assertion must not leave close() draining 100,000 steps
        service.close()
