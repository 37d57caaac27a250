"""Admission's estimate and its refusals against hand-computed values.

The cost model is a real ``CostModel`` fed one step per bucket: with one observation the fitted line
is flat and exact (slope 0, mean = the observed seconds), so every price below is a binary fraction
and the hand sums compare with ``==``. max_batch 2:

- bucket 8: a step 0.5 s, one sample-step at a full batch 0.25 s;
- bucket 16: a step measured at 0 s (a clock too coarse for the step), price 0.0;
- bucket 4: never measured, borrowed from bucket 8 at half the tokens: a step 0.25 s, price 0.125 s.

Live requests are stand-ins with the fields admission and the policies read off a ``Generation``.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest

from ldlm.serve.runtime.admission import Admission
from ldlm.serve.runtime.cost import CostModel, DeadlineUnreachableError, RequestTooLargeError
from ldlm.serve.runtime.policy import FirstComeFirstServed, LeastWorkFirst


@dataclass(frozen=True)
class Plan:
    n: int
    length: int
    steps: int


@dataclass(eq=False)
class Request:
    """What admission and ``LeastWorkFirst.priority`` read of a ``Generation``."""

    work: int
    bucket: int
    answered: bool = False
    waited_s: float = 0.0
    solo_s: float | None = None
    plan: Plan = Plan(1, 8, 1)
    submitted: float = 0.0
    waiting_since: float | None = None
    future: Future = field(default_factory=Future)

    def __post_init__(self) -> None:
        if self.answered:
            self.future.set_result(None)


def measured() -> CostModel:
    cost = CostModel(max_batch=2)
    cost.observe(8, 2, 0.5)
    cost.observe(16, 2, 0.0)
    return cost


def newcomer(n: int, steps: int) -> Request:
    """A request just submitted at length 8 (bucket 8): all its sample-steps are left."""
    return Request(work=n * steps, bucket=8, plan=Plan(n, 8, steps))


def test_the_prices_are_as_the_module_docs_say() -> None:
    cost = measured()
    assert (cost.sample_step_s(8), cost.sample_step_s(16), cost.sample_step_s(4)) == (0.25, 0.0, 0.125)
    assert cost.solo_s(1, 10, 8) == 5.0 and cost.solo_s(2, 10, 8) == 5.0  # one chunk of at most 2 samples


def test_the_work_ahead_is_every_unanswered_request_priced_in_its_own_bucket() -> None:
    cost = measured()
    admission = Admission(cost, FirstComeFirstServed(cost, 2))
    live = [
        Request(work=40, bucket=8, answered=True),  # answered first: skipped, the others still count
        Request(work=12, bucket=8),  # 12 x 0.25 = 3.0
        Request(work=7, bucket=16),  # measured at 0 s: 7 x 0.0 = 0.0
        Request(work=10, bucket=4),  # borrowed price: 10 x 0.125 = 1.25
    ]
    assert admission.estimate(6, 8, 1.5, live, 0.0) == (4.25, 1.5)
    assert admission.estimate(6, 8, 1.5, [], 0.0) == (0.0, 1.5)


def test_requests_that_yield_to_the_newcomer_do_not_count_and_the_rest_still_do() -> None:
    # the newcomer: 20 sample-steps in bucket 8, priority 20 x 0.25 = 5.0
    cost = measured()
    admission = Admission(cost, LeastWorkFirst(cost, 2))
    live = [
        Request(work=100, bucket=8),  # priority 25.0 > 5.0: yields, skipped
        Request(work=8, bucket=8),  # priority 2.0: runs first, 2.0 s ahead
        Request(work=4, bucket=8, answered=True),  # answered: skipped
        Request(work=12, bucket=8),  # priority 3.0: runs first, 3.0 s ahead
    ]
    assert admission.estimate(20, 8, 2.5, live, 0.0) == (5.0, 2.5)


def test_a_newcomer_in_a_zero_priced_bucket_is_ranked_at_zero() -> None:
    # the newcomer: 20 sample-steps in bucket 16 (0 s a step), priority 20 x 0.0 = 0.0
    cost = measured()
    admission = Admission(cost, LeastWorkFirst(cost, 2))
    live = [
        Request(work=40, bucket=8),  # priority 10.0 > 0.0: yields, skipped
        Request(work=8, bucket=8, waited_s=3.0, solo_s=0.5),  # 2.0 left - (3.0 waited - 0.5 grace) = -0.5: runs first
    ]
    assert admission.estimate(20, 16, 0.0, live, 0.0) == (2.0, 0.0)


def test_nothing_is_estimated_or_refused_before_a_step_was_measured() -> None:
    cost = CostModel(max_batch=2)
    admission = Admission(cost, FirstComeFirstServed(cost, 2))
    assert admission.estimate(20, 8, None, [Request(work=12, bucket=8)], 0.0) is None
    request = newcomer(4, 1000)
    admission.price(request, 1e-3, [Request(work=12, bucket=8)])
    assert request.solo_s is None


@pytest.mark.parametrize("n, samples", [(1, "1 sample"), (2, "2 samples")])
def test_a_request_estimated_exactly_at_its_deadline_alone_is_taken_and_one_just_over_refused(n: int, samples: str) -> None:
    cost = measured()
    admission = Admission(cost, FirstComeFirstServed(cost, 2))
    request = newcomer(n, 10)  # one chunk of 10 steps: 10 x 0.5 = 5.0 s alone
    admission.price(request, 5.0, [])
    assert request.solo_s == 5.0
    below = math.nextafter(5.0, 0.0)
    expected = (
        f"this request ({samples} x 10 steps at length 8) is estimated at 5.0 s even on an idle server, and its deadline is "
        "5.0 s; allowed: requests estimated within the deadline (fewer samples or steps)"
    )
    with pytest.raises(RequestTooLargeError, match=f"^{re.escape(expected)}$"):
        admission.price(newcomer(n, 10), below, [])


@pytest.mark.parametrize("n, samples", [(1, "1 sample"), (2, "2 samples")])
def test_a_request_estimated_exactly_at_its_deadline_behind_work_is_taken_and_one_just_over_refused(n: int, samples: str) -> None:
    cost = measured()
    admission = Admission(cost, FirstComeFirstServed(cost, 2))
    live = [Request(work=12, bucket=8)]  # 3.0 s ahead; the newcomer 5.0 s of its own: 8.0 s
    admission.price(newcomer(n, 10), 8.0, live)
    below = math.nextafter(8.0, 0.0)
    expected = (
        f"this request ({samples} x 10 steps at length 8) is estimated at 8.0 s (3.0 s of work queued ahead of it + "
        "5.0 s of its own), beyond its deadline of 8.0 s; retry in 3 s"
    )
    with pytest.raises(DeadlineUnreachableError, match=f"^{re.escape(expected)}$") as refused:
        admission.price(newcomer(n, 10), below, live)
    assert refused.value.retry_after_s == 3.0
