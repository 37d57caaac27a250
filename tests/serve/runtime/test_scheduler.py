"""Step-level continuous batching: same tokens as the pipeline, whatever shares the batch."""

from __future__ import annotations

import threading

import pytest
import torch

from ldlm.model.checkpoint import init_model
from ldlm.model.config import preset
from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling import resolve
from ldlm.serve.runtime.cost import CostModel
from ldlm.serve.runtime.delivery import slot_rows
from ldlm.serve.runtime.executor import StepExecutor
from ldlm.serve.runtime.generation import Preview, Sample
from ldlm.serve.runtime.queueing import QueueFullError
from ldlm.serve.runtime.scheduler import GenerateRequest, GenerationScheduler

REQUESTS = [
    GenerateRequest(n=2, length=9, steps=4, seed=1, sampler="sde"),
    GenerateRequest(n=1, length=17, steps=2, seed=2, sampler="ddim"),
    GenerateRequest(n=3, length=5, steps=6, seed=3, sampler="sde"),
    GenerateRequest(n=1, length=12, steps=3, seed=4, sampler="ddim", t_min=0.2),
]


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_mixed_requests_get_the_pipelines_tokens(pipeline: LDLMPipeline, policy: str) -> None:
    bucketed = LDLMPipeline(pipeline.graphs, pipeline.tokenizer, config=pipeline.config, buckets=(8, 16, 32))
    scheduler = GenerationScheduler(bucketed, max_batch=4, policy=policy, start=False)
    try:
        futures = [scheduler.submit(r) for r in REQUESTS]  # all queued before the first step
        scheduler.start()
        results = [f.result(timeout=60) for f in futures]
    finally:
        scheduler.close()
    for request, result in zip(REQUESTS, results):
        expected = pipeline.generate(request.n, request.length, request.steps, request.seed, request.sampler, request.t_min)
        assert result.token_ids.shape == (request.n, request.length)
        assert torch.equal(result.token_ids, expected.token_ids), request
        assert result.texts == expected.texts
    # Every sample-step ran exactly once, and samples shared denoiser calls.
    assert scheduler.samples_stepped == sum(r.n * r.steps for r in REQUESTS)
    assert scheduler.denoiser_calls < scheduler.samples_stepped


def test_bad_requests_fail_at_submit_and_the_queue_is_bounded(pipeline: LDLMPipeline) -> None:
    scheduler = GenerationScheduler(pipeline, max_batch=2, max_queue=3)
    try:
        with pytest.raises(ValueError, match="length=999 is out of range"):
            scheduler.submit(GenerateRequest(n=1, length=999, steps=2))
        with pytest.raises(ValueError, match="steps=0 is invalid"):
            scheduler.submit(GenerateRequest(n=1, length=4, steps=0))
        with pytest.raises(ValueError, match="n=0 is out of range"):
            scheduler.submit(GenerateRequest(n=0, length=4, steps=2))
        with pytest.raises(QueueFullError, match="queue is full"):
            scheduler.submit(GenerateRequest(n=4, length=4, steps=2))
        assert scheduler.generate(GenerateRequest(n=1, length=4, steps=2), timeout_s=30).token_ids.shape == (1, 4)
    finally:
        scheduler.close()


def test_a_failing_denoiser_answers_every_request(pipeline: LDLMPipeline) -> None:
    class Broken:
        def denoise(self, *args):
            raise RuntimeError("engine lost")

    broken = LDLMPipeline(Broken(), pipeline.tokenizer, config=pipeline.config)  # type: ignore[arg-type]
    scheduler = GenerationScheduler(broken, max_batch=4)
    try:
        futures = [scheduler.submit(GenerateRequest(n=1, length=4, steps=2, seed=s)) for s in range(3)]
        for future in futures:
            with pytest.raises(RuntimeError, match="engine lost"):
                future.result(timeout=30)
    finally:
        scheduler.close(timeout_s=10)


@pytest.mark.parametrize("stage", ["policy", "admission"])
def test_a_failure_in_deciding_answers_every_request_in_flight_and_the_next_is_served(pipeline: LDLMPipeline, stage: str) -> None:
    """A policy or the slot table raising while the worker decides (outside a step) reaches every request in
    flight, running or waiting, as its answer: none waits forever on a worker that died. The worker goes on, and
    the next request gets the tokens the pipeline gives it alone."""
    scheduler = GenerationScheduler(pipeline, max_batch=2, start=False)
    owner, name = (scheduler.policy, "select") if stage == "policy" else (scheduler.executor, "run")
    real = getattr(owner, name)
    calls = []

    def fails_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(f"{stage} broke")
        return real(*args, **kwargs)

    setattr(owner, name, fails_once)
    try:
        futures = [scheduler.submit(GenerateRequest(n=2, length=4, steps=2, seed=s)) for s in range(3)]  # 6 samples, 2 run at once
        scheduler.start()
        for future in futures:
            with pytest.raises(RuntimeError, match=f"{stage} broke"):
                future.result(timeout=30)
        spec = GenerateRequest(n=2, length=4, steps=2, seed=7)
        result = scheduler.generate(spec, timeout_s=30)
        assert torch.equal(result.token_ids, pipeline.generate(spec.n, spec.length, spec.steps, spec.seed).token_ids)
        assert (scheduler.active_samples, scheduler.queued_samples) == (0, 0)
    finally:
        scheduler.close(timeout_s=10)


def test_a_failing_preview_hook_ends_its_request_with_its_error(pipeline: LDLMPipeline, caplog: pytest.LogCaptureFixture) -> None:
    def broken_hook(previews: list[Preview]) -> None:
        raise ValueError("preview sink broke")

    scheduler = GenerationScheduler(pipeline, max_batch=4, start=False)
    try:
        failing = scheduler.submit(GenerateRequest(n=1, length=6, steps=4, seed=5), on_preview=broken_hook, preview_every=1)
        healthy = scheduler.submit(REQUESTS[0])  # shares the batch and is unaffected
        scheduler.start()
        with pytest.raises(ValueError, match="preview sink broke"):  # the real error, not CancelledError
            failing.result(timeout=60)
        expected = pipeline.generate(REQUESTS[0].n, REQUESTS[0].length, REQUESTS[0].steps, REQUESTS[0].seed, REQUESTS[0].sampler)
        assert torch.equal(healthy.result(timeout=60).token_ids, expected.token_ids)
    finally:
        scheduler.close()
    assert "preview hook failed" in caplog.text


def test_the_schedulers_thread_never_decodes(pipeline: LDLMPipeline) -> None:
    """Finished requests and previews are decoded on the delivery threads: a step never waits for a decoder
    call (and its device-to-host copy). Staggered requests, so samples finish while others still step."""
    threads: list[str] = []

    class Recording(LDLMPipeline):
        def decode(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            threads.append(threading.current_thread().name)
            return super().decode(*args, **kwargs)

    recording = Recording(pipeline.graphs, pipeline.tokenizer, config=pipeline.config)
    scheduler = GenerationScheduler(recording, max_batch=8)
    try:
        futures = [scheduler.submit(GenerateRequest(n=2, length=6, steps=3 + k, seed=k, sampler="ddim")) for k in range(4)]
        futures.append(scheduler.submit(GenerateRequest(n=1, length=6, steps=6, seed=9), on_preview=lambda p: None, preview_every=2))
        results = [f.result(timeout=60) for f in futures]
    finally:
        scheduler.close()
    assert len(results) == 5 and threads, "every request was answered through a decoder call"
    assert not [name for name in threads if name.startswith("ldlm-generation")], threads
    assert {name.split("_")[0] for name in threads} == {"ldlm-answers", "ldlm-previews"}


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: a served step's promise of no host sync (CUDA's sync debug mode over admission, "
    "steps, finishes and previews' gathers) was not exercised here",
)
def test_a_served_step_makes_no_host_sync_on_cuda() -> None:
    pipe = LDLMPipeline(init_model(preset("tiny"), seed=0).cuda(), TextTokenizer.gpt2(), device="cuda")
    states = []
    for k in range(3):  # staggered: other lengths (buckets) and step counts, so samples finish while others step
        states += pipe.engine.start(resolve(GenerateRequest(2, 8 + 8 * k, 3 + k, k), pipe.config), pipe.config.d_model)
    for state in states:
        state.watch = 2
    executor = StepExecutor(pipe.engine, pipe.graphs.denoise, pipe.bucket_length, CostModel(8))
    samples = [Sample(None, i, state) for i, state in enumerate(states)]  # type: ignore[arg-type]
    executor.run(samples[:2])
    executor.execute()  # warm-up: lazy CUDA initialisation may sync
    finished = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        executor.run(samples)  # admission beside a running sample
        while any(table.running for table in executor.tables.values()):
            step = executor.execute()
            finished += step.finished
            if step.due:
                slot_rows([s.state for s in step.due], "x0_hat")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(finished) == len(samples) and all(torch.isfinite(s.state.latent).all() for s in finished)  # type: ignore[arg-type]
