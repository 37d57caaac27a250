"""What a request asks of the scheduler and gets: a prompt prefix and a token sampling give the tokens the
pipeline's own run gives; previews come only to a hook, at the interval asked, within the scheduler's preview
shares (``busy`` beside other generations, ``alone`` without) and told to its preview observer; requests of a
static batch run in submission order; the estimate prices a request's n x steps sample-steps and counts the
samples of a request still to run; requests resolve under the scheduler's limits and its pipeline's tuned grids; a
failed step answers its batch and the rest are served; dropped samples add up; ``close`` answers what is in
flight; and the waits of ``generate`` and ``close`` end at their timeouts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ldlm.pipeline import LDLMPipeline
from ldlm.sampling import RequestLimits
from ldlm.sampling.tokens import TokenSampling
from ldlm.sampling.tuned_grids import TunedGrid, TunedSchedules
from ldlm.serve.runtime.cost import CostModel
from ldlm.serve.runtime.delivery import PreviewShares
from ldlm.serve.runtime.generation import Preview
from ldlm.serve.runtime.queueing import QueueFullError
from ldlm.serve.runtime.scheduler import GenerateRequest, GenerationScheduler
from tests.serve.runtime.test_scheduler_fairness import FixedCost

SPEC = GenerateRequest(n=2, length=8, steps=3, seed=7, sampler="ddim")


def in_thread(call: Callable[[], Any], wait_s: float = 10.0) -> tuple[bool, list[BaseException]]:
    """Run ``call`` on a daemon thread for up to ``wait_s``: (whether it returned by then, what it raised)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as error:  # handed back to the test
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(wait_s)
    return not thread.is_alive(), raised


def test_a_prompt_prefix_gives_the_pipelines_own_prompted_tokens(pipeline: LDLMPipeline) -> None:
    prefix = pipeline.prompt_latents([464, 3290, 318], SPEC.length)
    scheduler = GenerationScheduler(pipeline, max_batch=4)
    try:
        prompted = scheduler.submit(SPEC, prefix=prefix).result(timeout=60)
    finally:
        scheduler.close(timeout_s=30)
    alone = pipeline.sample_latents(SPEC.n, SPEC.length, SPEC.steps, SPEC.seed, SPEC.sampler, prefix=prefix)
    expected = pipeline.decode(alone).token_ids
    assert torch.equal(prompted.token_ids, expected)
    unprompted = pipeline.generate(SPEC.n, SPEC.length, SPEC.steps, SPEC.seed, SPEC.sampler).token_ids
    assert not torch.equal(expected, unprompted)  # the prefix matters to these tokens


def test_a_token_sampling_gives_the_pipelines_own_sampled_tokens(pipeline: LDLMPipeline) -> None:
    sampling = TokenSampling(temperature=1.5, top_p=0.95, seed=3)
    scheduler = GenerationScheduler(pipeline, max_batch=4)
    try:
        sampled = scheduler.submit(SPEC, decoding=sampling).result(timeout=60)
    finally:
        scheduler.close(timeout_s=30)
    latents = pipeline.sample_latents(SPEC.n, SPEC.length, SPEC.steps, SPEC.seed, SPEC.sampler)
    assert torch.equal(sampled.token_ids, pipeline.decode(latents, sampling=sampling).token_ids)
    assert not torch.equal(sampled.token_ids, pipeline.decode(latents).token_ids)  # not the argmax


def test_previews_come_to_a_hook_at_the_interval_asked_and_none_without_one(pipeline: LDLMPipeline) -> None:
    """preview_every defaults to 0: a hook given no interval gets no previews. (A busy share of 1: none is dropped.)"""
    spec = GenerateRequest(n=1, length=6, steps=7, seed=5, sampler="ddim")
    every: list[int] = []
    unasked: list[int] = []
    scheduler = GenerationScheduler(pipeline, max_batch=4, start=False, previews=PreviewShares(busy=1.0))
    try:
        futures = [
            scheduler.submit(spec, on_preview=lambda previews: every.extend(p.step for p in previews), preview_every=2),
            scheduler.submit(spec, on_preview=lambda previews: unasked.extend(p.step for p in previews)),
        ]
        scheduler.start()
        for future in futures:
            future.result(timeout=60)
    finally:
        scheduler.close(timeout_s=30)
    assert every == [2, 4, 6] and unasked == []


class HeldPreviews(LDLMPipeline):
    """Each preview call is held until a request's own decode: every step before that has run meanwhile."""

    def __init__(self, pipeline: LDLMPipeline) -> None:
        super().__init__(pipeline.graphs, pipeline.tokenizer, config=pipeline.config)
        self.answered = threading.Event()

    def decode(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if threading.current_thread().name.startswith("ldlm-previews"):
            assert self.answered.wait(30)
        else:
            self.answered.set()
        return super().decode(*args, **kwargs)


def held_previews(
    pipeline: LDLMPipeline, shares: PreviewShares, alongside: GenerateRequest | None = None
) -> tuple[list[int], list[tuple[int, int]]]:
    """A request of 5 steps previewed at every step (the steps 1 to 4), beside ``alongside`` (no previews) if
    given, each preview call held: (the steps its hook got, the observer's (decoded, dropped) counts)."""
    seen: list[tuple[int, int]] = []
    got: list[Preview] = []
    scheduler = GenerationScheduler(
        HeldPreviews(pipeline),
        max_batch=4,
        start=False,
        previews=shares,
        on_previews=lambda decoded, dropped, seconds: seen.append((decoded, dropped)),
    )
    try:
        spec = GenerateRequest(n=1, length=6, steps=5, seed=2, sampler="ddim")
        futures = [scheduler.submit(spec, on_preview=got.extend, preview_every=1)]
        if alongside is not None:
            futures.append(scheduler.submit(alongside))
        scheduler.start()
        for future in futures:
            future.result(timeout=60)
    finally:
        scheduler.close(timeout_s=30)
    return [p.step for p in got], seen


def test_the_preview_shares_and_observer_reach_the_preview_decodes(pipeline: LDLMPipeline) -> None:
    """A request alone under an ``alone`` share of 0.5: the previews due while the first call still runs are
    dropped, and the observer is told of each drop and of the call. (The default ``alone`` share, 1, drops none.)"""
    steps, seen = held_previews(pipeline, PreviewShares(busy=1.0, alone=0.5))
    assert steps == [1]  # steps 2, 3 and 4 came while step 1's call was held
    assert seen == [(0, 1), (0, 1), (0, 1), (1, 0)]


def test_the_busy_share_holds_while_another_generation_is_in_flight(pipeline: LDLMPipeline) -> None:
    """Beside a longer request the ``busy`` share (0.5) applies, not the ``alone`` one (1)."""
    beside = GenerateRequest(n=1, length=6, steps=12, seed=3, sampler="ddim")
    steps, seen = held_previews(pipeline, PreviewShares(busy=0.5, alone=1.0), alongside=beside)
    assert steps == [1] and seen == [(0, 1), (0, 1), (0, 1), (1, 0)]
    steps, seen = held_previews(pipeline, PreviewShares(busy=0.5, alone=1.0))  # and alone, the alone one
    assert steps == [1, 2, 3, 4] and seen == [(1, 0)] * 4


def test_a_static_batch_takes_requests_in_submission_order(pipeline: LDLMPipeline) -> None:
    done: list[int] = []
    scheduler = GenerationScheduler(pipeline, max_batch=1, policy="static", start=False)
    try:
        futures = [scheduler.submit(GenerateRequest(n=1, length=4, steps=2, seed=k)) for k in range(3)]
        for k, future in enumerate(futures):
            future.add_done_callback(lambda _, k=k: done.append(k))
        scheduler.start()
        for future in futures:
            future.result(timeout=60)
    finally:
        scheduler.close(timeout_s=30)
    assert done == [0, 1, 2]


def test_the_estimate_prices_n_times_steps_sample_steps(pipeline: LDLMPipeline) -> None:
    """A queued request of 8 sample-steps runs before a newcomer of 2 x 10 (less work first): it is the work ahead."""
    scheduler = GenerationScheduler(pipeline, max_batch=2, start=False)
    bucket = pipeline.bucket_length(4)
    cost = CostModel(max_batch=2)
    cost.observe(bucket, 2, 2.0)  # 1 s per sample-step: waiting never outweighs the work
    scheduler.cost = cost
    price = cost.sample_step_s(bucket)
    assert price == 1.0
    scheduler.submit(GenerateRequest(n=1, length=4, steps=8))
    newcomer = GenerateRequest(n=2, length=4, steps=10)
    assert scheduler.estimate_s(newcomer) == (8 * price, cost.solo_s(2, 10, bucket))


def test_a_full_queue_of_an_owner_naming_no_setting_names_none(pipeline: LDLMPipeline) -> None:
    scheduler = GenerationScheduler(pipeline, max_queue=2, start=False)
    with pytest.raises(QueueFullError) as refused:
        scheduler.submit(GenerateRequest(n=3, length=4, steps=2))
    assert str(refused.value).endswith("max 2 samples; retry later, or raise the limit")


def test_a_closed_scheduler_refuses_new_requests_by_name(pipeline: LDLMPipeline) -> None:
    scheduler = GenerationScheduler(pipeline, max_batch=2)
    scheduler.close(timeout_s=30)
    with pytest.raises(RuntimeError, match="^the scheduler is shut down$"):
        scheduler.submit(GenerateRequest(n=1, length=4, steps=2))


def test_generate_gives_up_at_its_timeout(pipeline: LDLMPipeline) -> None:
    scheduler = GenerationScheduler(pipeline, max_batch=2, start=False)  # nothing steps: no answer comes
    try:
        returned, raised = in_thread(lambda: scheduler.generate(GenerateRequest(n=1, length=4, steps=2), timeout_s=0.2))
        assert returned and len(raised) == 1 and isinstance(raised[0], TimeoutError), raised
    finally:
        scheduler.start()
        scheduler.close(timeout_s=30)


def held_denoiser(pipeline: LDLMPipeline) -> tuple[threading.Event, threading.Event, Callable[..., Any]]:
    """The pipeline's denoiser held inside its first call: ``entered`` once a step is in it, which ends on ``release``."""
    entered, release = threading.Event(), threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert release.wait(30)
        return pipeline.graphs.denoise(*args, **kwargs)

    return entered, release, held


def test_close_waits_for_the_worker_only_up_to_its_timeout_and_the_request_running_is_still_answered(pipeline: LDLMPipeline) -> None:
    """A close that stops waiting leaves the worker to finish: the request inside the held step gets its tokens after."""
    entered, release, held = held_denoiser(pipeline)
    spec = GenerateRequest(n=1, length=4, steps=2, seed=5, sampler="ddim")
    scheduler = GenerationScheduler(pipeline, max_batch=2, denoise=held)
    try:
        future = scheduler.submit(spec)
        assert entered.wait(30)  # the worker is inside a step that does not end
        returned, raised = in_thread(lambda: scheduler.close(timeout_s=0.2))
        assert returned and not raised, raised
        assert not future.done()
    finally:
        release.set()
    expected = pipeline.generate(n=1, length=4, steps=2, seed=5, sampler="ddim").token_ids
    assert torch.equal(future.result(timeout=30).token_ids, expected)


def test_close_answers_every_request_still_queued_or_running(pipeline: LDLMPipeline) -> None:
    """Closed while a step is held and more requests wait: each still gets the pipeline's own tokens."""
    entered, release, held = held_denoiser(pipeline)
    specs = [GenerateRequest(n=1, length=4, steps=3, seed=k, sampler="ddim") for k in range(3)]
    scheduler = GenerationScheduler(pipeline, max_batch=1, denoise=held)
    closing = threading.Thread(target=scheduler.close, daemon=True)
    try:
        futures = [scheduler.submit(spec) for spec in specs]
        assert entered.wait(30)
        closing.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the close is under way: new requests are refused
            try:
                scheduler.submit(specs[0]).cancel()
            except RuntimeError:
                break
            time.sleep(0.01)
    finally:
        release.set()
    for spec, future in zip(specs, futures):
        expected = pipeline.generate(spec.n, spec.length, spec.steps, spec.seed, spec.sampler).token_ids
        assert torch.equal(future.result(timeout=10).token_ids, expected)
    closing.join(30)
    assert not closing.is_alive()


def test_dropped_samples_add_up_over_the_requests_that_left(pipeline: LDLMPipeline) -> None:
    """Cancelled requests' waiting samples leave the queue when a new request needs their places: every drop counts."""
    dropped: list[int] = []
    scheduler = GenerationScheduler(pipeline, max_queue=4, start=False, on_drop=dropped.append)  # nothing steps
    for n in (2, 3):
        assert scheduler.submit(GenerateRequest(n=n, length=4, steps=2)).cancel()
        scheduler.submit(GenerateRequest(n=4, length=4, steps=2)).cancel()  # needs the places: the cancelled leave
    assert dropped == [2, 4, 3] and scheduler.dropped_samples == 9  # the last cancelled 4 still wait: nothing needed them


def test_a_request_with_samples_still_to_run_is_work_ahead_in_the_estimate(pipeline: LDLMPipeline) -> None:
    """One slot, a request of 2 samples x 2 steps: once its first sample finished, its second (2 steps left)
    is still work that runs before a newcomer of 4 sample-steps."""
    entered, go = threading.Semaphore(0), threading.Semaphore(0)

    def stepwise(*args: Any, **kwargs: Any) -> Any:
        entered.release()
        assert go.acquire(timeout=30)
        return pipeline.graphs.denoise(*args, **kwargs)

    bucket = pipeline.bucket_length(4)
    scheduler = GenerationScheduler(pipeline, max_batch=1, denoise=stepwise, start=False)
    scheduler.cost = FixedCost(1, 0.0, 1.0, bucket)  # 1 s per sample-step: waiting never outweighs the work
    try:
        future = scheduler.submit(GenerateRequest(n=2, length=4, steps=2, seed=1))
        scheduler.start()
        for _ in range(2):  # the first sample's two steps
            assert entered.acquire(timeout=30)
            go.release()
        assert entered.acquire(timeout=30)  # the second sample's first step: the first one's end was handled
        assert scheduler.estimate_s(GenerateRequest(n=1, length=4, steps=4)) == (2.0, 4.0)
        go.release(2)
        future.result(timeout=30)
    finally:
        go.release(10)
        scheduler.close(timeout_s=30)


def test_requests_are_resolved_under_the_schedulers_limits(pipeline: LDLMPipeline) -> None:
    scheduler = GenerationScheduler(pipeline, max_batch=2, start=False, limits=RequestLimits(max_n=2, max_steps=5))
    with pytest.raises(ValueError, match=r"^n=3 is out of range; allowed: 1\.\.2$"):
        scheduler.submit(GenerateRequest(n=3, length=4, steps=2))
    with pytest.raises(ValueError, match=r"^steps=6 is out of range; allowed: 1\.\.5$"):
        scheduler.submit(GenerateRequest(n=1, length=4, steps=6))
    assert scheduler.queued_samples == 0


def test_a_request_naming_no_steps_runs_the_pipelines_tuned_grid(pipeline: LDLMPipeline) -> None:
    """A checkpoint's tuned grids: its default step count and its grid, the tokens the tuned pipeline gives."""
    config = pipeline.config
    times = (1.0, 0.5, 0.2, config.t_min)
    tuned = TunedSchedules("0" * 64, config.t_min, (TunedGrid("ddim", 3, times),), {"ddim": 3}, config.prior_temperature_for(None))
    tuned_pipeline = LDLMPipeline(pipeline.graphs, pipeline.tokenizer, config=config, schedules=tuned)
    spec = GenerateRequest(n=1, length=6, seed=4, sampler="ddim")
    scheduler = GenerationScheduler(tuned_pipeline, max_batch=2)
    try:
        plan = scheduler.plan(spec)
        result = scheduler.submit(spec).result(timeout=60)
    finally:
        scheduler.close(timeout_s=30)
    assert (plan.grid, plan.steps, plan.tuned_times) == ("tuned", 3, times)
    expected = tuned_pipeline.generate(spec.n, spec.length, seed=spec.seed, sampler=spec.sampler)
    assert torch.equal(result.token_ids, expected.token_ids)


def test_a_failed_step_answers_its_batch_and_the_waiting_requests_are_served_after_it(pipeline: LDLMPipeline) -> None:
    """One slot; the first step fails: its request gets the error, the two still waiting their own tokens."""
    calls: list[int] = []

    def fails_first(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("step lost")
        return pipeline.graphs.denoise(*args, **kwargs)

    specs = [GenerateRequest(n=1, length=4, steps=2, seed=k, sampler="ddim") for k in range(3)]
    scheduler = GenerationScheduler(pipeline, max_batch=1, denoise=fails_first, start=False)
    try:
        futures = [scheduler.submit(spec) for spec in specs]
        scheduler.start()
        with pytest.raises(RuntimeError, match="^step lost$"):
            futures[0].result(timeout=30)
        for spec, future in zip(specs[1:], futures[1:]):
            expected = pipeline.generate(spec.n, spec.length, spec.steps, spec.seed, spec.sampler).token_ids
            assert torch.equal(future.result(timeout=30).token_ids, expected)
    finally:
        scheduler.close(timeout_s=30)
