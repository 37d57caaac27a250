"""The generation queue's bound is inclusive: requests whose samples exactly fill ``max_queue`` are queued, and one
sample more is refused. Also where the room comes from a cancelled request's samples, which leave the queue when a
new request needs their places."""

from __future__ import annotations

import pytest

from ldlm.pipeline import LDLMPipeline
from ldlm.sampling import GenerateRequest
from ldlm.serve.runtime.queueing import QueueFullError
from ldlm.serve.runtime.scheduler import GenerationScheduler

MAX_QUEUE = 32


def request(n: int) -> GenerateRequest:
    return GenerateRequest(n=n, length=4, steps=2)


def refused(scheduler: GenerationScheduler, n: int, waiting: int) -> None:
    with pytest.raises(QueueFullError, match=f"{waiting} samples waiting and {n} asked, max {MAX_QUEUE} samples"):
        scheduler.submit(request(n))


@pytest.mark.parametrize("sizes", [(MAX_QUEUE,), (1, MAX_QUEUE - 1), (20, 11, 1)], ids=lambda s: "+".join(map(str, s)))
def test_requests_that_exactly_fill_the_queue_are_taken_and_one_sample_more_is_refused(
    pipeline: LDLMPipeline, sizes: tuple[int, ...]
) -> None:
    # not started: no thread takes samples off the queue, so what waits is what was submitted
    scheduler = GenerationScheduler(pipeline, max_batch=4, max_queue=MAX_QUEUE, start=False)
    for n in sizes:
        scheduler.submit(request(n))
    assert scheduler.queued_samples == MAX_QUEUE
    refused(scheduler, 1, MAX_QUEUE)


def test_a_cancelled_requests_places_are_taken_up_to_the_bound_exactly(pipeline: LDLMPipeline) -> None:
    scheduler = GenerationScheduler(pipeline, max_batch=4, max_queue=MAX_QUEUE, start=False)
    gone = scheduler.submit(request(20))
    scheduler.submit(request(MAX_QUEUE - 20))
    assert gone.cancel()
    scheduler.submit(request(20))  # the cancelled 20 leave: 12 + 20 waiting, the bound exactly
    assert scheduler.queued_samples == MAX_QUEUE
    refused(scheduler, 1, MAX_QUEUE)
