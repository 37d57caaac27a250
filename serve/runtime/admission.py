"""Admission by cost: a request with a deadline is refused at once, before it is queued, when the
measured cost model says it cannot finish in time.

The estimate of a request is its own time alone plus the work of every live request that would
run before it (at full batches; under ``LeastWorkFirst`` a request with more work left yields to
the newcomer, so only the others count). ``RequestTooLargeError`` (413) if it could not fit even
alone, else ``DeadlineUnreachableError`` (503) with a time to retry: the work queued ahead of it,
rounded up. Nothing is refused before a step was measured: no refusal on a guess.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ldlm.serve.runtime.cost import CostModel, DeadlineUnreachableError, RequestTooLargeError
from ldlm.serve.runtime.generation import Generation
from ldlm.serve.runtime.policy import SchedulingPolicy


class Admission:
    def __init__(self, cost: CostModel, policy: SchedulingPolicy) -> None:
        self.cost = cost
        self.policy = policy

    def price(self, request: Generation, deadline_s: float | None, live: Iterable[Generation]) -> None:
        """Set a new request's price (its time alone) and refuse it if it cannot meet ``deadline_s``."""
        plan = request.plan
        request.solo_s = self.cost.solo_s(plan.n, plan.steps, request.bucket)
        if deadline_s is None or request.solo_s is None:
            return  # nothing measured yet: nothing is refused on a guess
        what = f"{plan.n} sample{'s' if plan.n > 1 else ''} x {plan.steps} steps at length {plan.length}"
        if request.solo_s > deadline_s:
            raise RequestTooLargeError(
                f"this request ({what}) is estimated at {request.solo_s:.1f} s even on an idle server, and its deadline is "
                f"{deadline_s:.1f} s; allowed: requests estimated within the deadline (fewer samples or steps)"
            )
        ahead, own = self.estimate(request.work, request.bucket, request.solo_s, live, request.submitted)  # type: ignore[misc]
        if ahead + own > deadline_s:
            raise DeadlineUnreachableError(
                f"this request ({what}) is estimated at {ahead + own:.1f} s ({ahead:.1f} s of work queued ahead of it + "
                f"{own:.1f} s of its own), beyond its deadline of {deadline_s:.1f} s; retry in {math.ceil(ahead)} s",
                retry_after_s=max(1.0, ahead),
            )

    def estimate(self, work: int, bucket: int, solo_s: float | None, live: Iterable[Generation], now: float) -> tuple[float, float] | None:
        """(seconds of the work that runs first, the request's own time), or None before any step was measured."""
        if solo_s is None:
            return None
        price = self.cost.sample_step_s(bucket) or 0.0
        mine = work * price  # what the policy's priority would say of the new request
        ahead = 0.0
        for request in live:
            if request.future.done() or self.policy.yields_to_newcomer(request, mine, now):
                continue  # answered, or it yields to the new request
            ahead += request.work * (self.cost.sample_step_s(request.bucket) or 0.0)
        return ahead, solo_s
