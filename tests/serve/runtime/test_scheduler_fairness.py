"""The scheduler's order and admission: a short request joins at the next step (taking a slot from
the request with the most work left, which resumes with the same tokens), nothing starves, and a
request that cannot meet its deadline is refused up front with the estimate named. Schedules are
hand-counted; estimates are computed by hand from step times fed to the cost model."""

from __future__ import annotations

import pytest
import torch

from ldlm.pipeline import LDLMPipeline
from ldlm.serve.runtime.cost import CostModel, DeadlineUnreachableError, RequestTooLargeError
from ldlm.serve.runtime.scheduler import GenerateRequest, GenerationScheduler


def test_a_short_request_takes_a_slot_at_the_next_step_and_the_long_one_resumes(pipeline: LDLMPipeline) -> None:
    """max_batch=1. L (4 steps) runs; S (1 step) arrives during L's first step:
    [L] -> [S] (L waits, its state kept) -> [L] -> [L] -> [L]; both give their single runs' tokens."""
    for sampler in ("sde", "dpm2m"):  # a noise stream, and a multistep solver's history, carried across the pause
        long = GenerateRequest(n=1, length=6, steps=4, seed=41, sampler=sampler)
        short = GenerateRequest(n=1, length=6, steps=1, seed=42, sampler=sampler)
        order: list[list[int]] = []
        futures = []

        def observe(batch: int, queued: float, compute: float) -> None:
            # runs inside this iteration's scheduler only, so the loop's current names are the right ones
            order.append([s.request.spec.seed for s in scheduler._active.values()])  # noqa: B023
            if len(order) == 1:  # noqa: B023
                futures.append(scheduler.submit(short))  # noqa: B023

        scheduler = GenerationScheduler(pipeline, max_batch=1, start=False, observer=observe)
        try:
            futures.append(scheduler.submit(long))
            scheduler.start()
            results = [futures[0].result(timeout=60), futures[1].result(timeout=60)]
        finally:
            scheduler.close(timeout_s=30)
        assert order == [[41], [42], [41], [41], [41]], sampler
        for request, result in zip((long, short), results):
            alone = pipeline.generate(request.n, request.length, request.steps, request.seed, request.sampler)
            assert torch.equal(result.token_ids, alone.token_ids), (sampler, request)


def test_a_long_request_is_not_starved_by_a_stream_of_short_ones(pipeline: LDLMPipeline) -> None:
    """max_batch=1: a new one-step request arrives at every step. Least work first alone would run
    only short ones while they keep coming; aging lets the long one through once it has waited
    longer than its own time alone."""
    long = GenerateRequest(n=1, length=6, steps=3, seed=51, sampler="ddim")
    ran: list[int] = []
    futures = []

    def observe(batch: int, queued: float, compute: float) -> None:
        ran.append(next(iter(scheduler._active.values())).request.spec.seed)
        if len(ran) < 300 and not futures[0].done():
            futures.append(scheduler.submit(GenerateRequest(n=1, length=6, steps=1, seed=1000 + len(ran), sampler="ddim")))

    scheduler = GenerationScheduler(pipeline, max_batch=1, start=False, observer=observe)
    # priced at 10 ms a step (not learned from the real steps): L alone is 30 ms, a short one 10 ms. L outranks a
    # fresh short request once 30 ms - (waited - 30 ms) < 10 ms, i.e. after waiting 50 ms: some tens of steps here
    scheduler.cost = FixedCost(1, 0.0, 0.010, pipeline.bucket_length(6))
    try:
        futures.append(scheduler.submit(long))
        futures.append(scheduler.submit(GenerateRequest(n=1, length=6, steps=1, seed=999, sampler="ddim")))
        scheduler.start()
        futures[0].result(timeout=120)
    finally:
        scheduler.close(timeout_s=60)
    finished_at = len(ran) - ran[::-1].index(51)
    assert ran.count(51) == 3 and finished_at < 100, f"the long request finished at step {finished_at} of {len(ran)}"


def fed(max_batch: int) -> CostModel:
    """Step times for bucket 8: one sample 10 ms, two 12 ms (a = 8 ms per call, b = 2 ms per sample)."""
    cost = CostModel(max_batch)
    for _ in range(5):
        cost.observe(8, 1, 0.010)
        cost.observe(8, 2, 0.012)
    return cost


def test_the_cost_model_recovers_the_step_line() -> None:
    cost = fed(2)
    assert cost.step_s(8, 1) == pytest.approx(0.010) and cost.step_s(8, 2) == pytest.approx(0.012)
    assert cost.sample_step_s(8) == pytest.approx(0.006)  # a full batch of 2: 12 ms for 2 sample-steps
    assert cost.solo_s(4, 100, 8) == pytest.approx(2 * 100 * 0.012)  # two chunks of 2
    assert cost.step_s(16, 2) == pytest.approx(0.024)  # never measured: borrowed from bucket 8, twice the tokens
    assert CostModel(2).step_s(8, 1) is None and CostModel(2).solo_s(1, 10, 8) is None


def test_requests_that_cannot_meet_their_deadline_are_refused_naming_the_estimate(pipeline: LDLMPipeline) -> None:
    scheduler = GenerationScheduler(pipeline, max_batch=2, start=False)  # nothing runs: the queue stays as built
    scheduler.cost = fed(2)
    length = 8  # bucket 8 (the tiny pipeline's buckets are its lengths)
    assert pipeline.bucket_length(length) == 8
    try:
        with pytest.raises(
            RequestTooLargeError,
            match=r"this request \(4 samples x 100 steps at length 8\) is estimated at 2\.4 s "
            r"even on an idle server, and its deadline is 2\.0 s",
        ):
            scheduler.submit(GenerateRequest(n=4, length=length, steps=100), deadline_s=2.0)
        x = scheduler.submit(GenerateRequest(n=2, length=length, steps=100))  # 200 sample-steps: 1.2 s at full batches
        # 1 x 300 steps (1.8 s of work) runs after X: 1.2 s ahead + 300 x 10 ms alone = 4.2 s
        with pytest.raises(
            DeadlineUnreachableError,
            match=r"estimated at 4\.2 s \(1\.2 s of work queued ahead of it \+ 3\.0 s of its "
            r"own\), beyond its deadline of 3\.5 s; retry in 2 s",
        ) as refused:
            scheduler.submit(GenerateRequest(n=1, length=length, steps=300), deadline_s=3.5)
        assert refused.value.retry_after_s == pytest.approx(1.2)
        y = scheduler.submit(GenerateRequest(n=1, length=length, steps=300), deadline_s=4.5)
        # 10 steps (0.06 s of work) go before X and Y: nothing ahead, 10 x 10 ms of its own
        assert scheduler.estimate_s(GenerateRequest(n=1, length=length, steps=10)) == pytest.approx((0.0, 0.1))
        z = scheduler.submit(GenerateRequest(n=1, length=length, steps=10), deadline_s=0.2)
        assert scheduler.queued_samples == 4
        for future in (x, y, z):
            future.cancel()
    finally:
        scheduler.start()
        scheduler.close(timeout_s=30)
    assert scheduler.dropped_samples == 4


class FixedCost(CostModel):
    """A cost model that keeps the step times it is given (the real steps' times are not learned)."""

    def __init__(self, max_batch: int, overhead_s: float, per_sample_s: float, bucket: int) -> None:
        super().__init__(max_batch)
        for k in range(1, max_batch + 1):
            super().observe(bucket, k, overhead_s + per_sample_s * k)

    def observe(self, bucket: int, samples: int, seconds: float) -> None:
        pass


@pytest.mark.parametrize(
    "kind, overhead_s, per_sample_s, with_short",
    [
        # a step's cost grows with its batch (a CPU): 1 sample 11 ms, 2 samples 21 ms <= 2 x 11, 3 samples 31 ms > 22
        ("cpu", 0.001, 0.010, [42, 41]),
        # batching nearly free (a GPU below its limit): 4 samples 10.4 ms <= 2 x 10.1 ms, the batch fills
        ("gpu", 0.010, 0.0001, [42, 41, 41, 41]),
    ],
)
def test_a_short_request_gets_little_company_where_batching_costs(
    pipeline: LDLMPipeline, kind: str, overhead_s: float, per_sample_s: float, with_short: list[int]
) -> None:
    """max_batch=4: L (4 samples x 3 steps) runs; S (1 x 2) arrives during L's first step. While S runs,
    lower-ranked samples join only while S's step stays within 2x its step alone (LEAD_SLOWDOWN)."""
    long = GenerateRequest(n=4, length=6, steps=3, seed=41, sampler="ddim")
    short = GenerateRequest(n=1, length=6, steps=2, seed=42, sampler="ddim")
    batches: list[list[int]] = []
    futures = []

    def observe(batch: int, queued: float, compute: float) -> None:
        batches.append(sorted((s.request.spec.seed for s in scheduler._active.values()), reverse=True))
        if len(batches) == 1:
            futures.append(scheduler.submit(short))

    scheduler = GenerationScheduler(pipeline, max_batch=4, start=False, observer=observe)
    scheduler.cost = FixedCost(4, overhead_s, per_sample_s, pipeline.bucket_length(6))
    try:
        futures.append(scheduler.submit(long))
        scheduler.start()
        results = [futures[0].result(timeout=60), futures[1].result(timeout=60)]
    finally:
        scheduler.close(timeout_s=30)
    assert batches[:3] == [[41] * 4, with_short, with_short], kind
    assert sum(len(b) for b in batches) == 4 * 3 + 2 and all(b == [41] * len(b) for b in batches[3:])
    for request, result in zip((long, short), results):
        alone = pipeline.generate(request.n, request.length, request.steps, request.seed, request.sampler)
        assert torch.equal(result.token_ids, alone.token_ids), (kind, request)
