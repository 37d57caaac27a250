"""Deciding which samples run the next step: the scheduling policies, as classes behind one interface.

- ``LeastWorkFirst`` (continuous batching): at every step the batch holds the samples of the
  requests with the least remaining work (priced in seconds by the measured ``CostModel``), so a
  short request that arrives while long ones fill the batch joins at the next step, taking a slot
  from the request with the most work left. That sample is not set back: its state stays with it
  and it resumes where it stopped, with the same tokens. The first request in that order gets no
  more company than keeps its step within ``LEAD_SLOWDOWN`` of its step alone (where a step's cost
  grows with its batch, as on a CPU, a short request runs nearly alone for its few steps). Nothing
  starves: a request that has waited longer than its own time alone gains priority with every
  further second it waits, until it outranks any newcomer.
- ``FirstComeFirstServed`` (static batching): a batch is admitted only once the previous one has
  fully finished, in submission order: the baseline continuous batching must beat.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

from ldlm.serve.runtime.cost import CostModel
from ldlm.serve.runtime.generation import Generation, Sample, WaitingQueue

# A step of the request with the least work left is at most this much slower than the step it would
# take alone: where a step's cost grows with its batch (a CPU, a saturated GPU) a short request then
# runs with little company, and where batching is nearly free (a GPU below its limit) the batch fills.
# 2, measured on the 2-core CPU (scripts/research/fairness.py, docs/measurements/fairness-2026-12-01.json): at 3
# the 8-step requests' p99 beside 1000-step ones rose past 3x their p99 alone for ~4% more long throughput.
LEAD_SLOWDOWN = 2.0


class SchedulingPolicy(ABC):
    """Chooses the samples of the next step from the running ones and the waiting queue."""

    name: str

    def __init__(self, cost: CostModel, max_batch: int) -> None:
        self.cost = cost
        self.max_batch = max_batch

    @abstractmethod
    def select(self, active: list[Sample], waiting: WaitingQueue, now: float) -> list[Sample]:
        """The next step's samples; samples taken from ``waiting`` leave it, running ones left out go back to it."""

    @abstractmethod
    def yields_to_newcomer(self, request: Generation, newcomer_priority: float, now: float) -> bool:
        """Whether live ``request`` would let a new request of ``newcomer_priority`` run first (admission's estimate)."""

    def priority(self, request: Generation, now: float) -> float:
        """Seconds of work left, less one second for every second waited beyond its own time alone."""
        price = self.cost.sample_step_s(request.bucket)
        left = request.work * (price if price is not None else request.bucket * 1e-6)
        waited = request.waited_s + (now - request.waiting_since if request.waiting_since is not None else 0.0)
        grace = request.solo_s if request.solo_s is not None else 1.0
        return left - max(0.0, waited - grace)


class FirstComeFirstServed(SchedulingPolicy):
    name = "static"

    def select(self, active: list[Sample], waiting: WaitingQueue, now: float) -> list[Sample]:
        if not waiting or active:
            return active
        chosen: list[Sample] = []
        for request in sorted(waiting.requests(), key=lambda r: r.order):
            while waiting.of(request) and len(chosen) < self.max_batch:
                chosen.append(waiting.take(request, now))
        return chosen

    def yields_to_newcomer(self, request: Generation, newcomer_priority: float, now: float) -> bool:
        return False


class LeastWorkFirst(SchedulingPolicy):
    name = "continuous"

    def select(self, active: list[Sample], waiting: WaitingQueue, now: float) -> list[Sample]:
        if not waiting:
            return active
        requests = {id(s.request): s.request for s in active}
        requests.update((id(r), r) for r in waiting.requests())
        ranked = sorted(requests.values(), key=lambda r: (self.priority(r, now), r.order))
        running: dict[int, list[Sample]] = {}
        for sample in active:
            running.setdefault(id(sample.request), []).append(sample)
        lead = ranked[0]
        lead_samples = len(running.get(id(lead), ())) + len(waiting.of(lead))
        alone = self.cost.step_s(lead.bucket, min(lead_samples, self.max_batch))
        limit = math.inf if alone is None else LEAD_SLOWDOWN * alone
        chosen: list[Sample] = []
        per_bucket: dict[int, int] = {}
        for request in ranked:
            candidates = [(sample, False) for sample in running.get(id(request), [])]  # its running samples first
            candidates += [(sample, True) for sample in waiting.of(request)]
            for sample, queued in candidates:
                fits = len(chosen) < self.max_batch and (request is lead or self._batch_s(per_bucket, request.bucket) <= limit)
                if fits:
                    per_bucket[request.bucket] = per_bucket.get(request.bucket, 0) + 1
                    chosen.append(waiting.take(request, now) if queued else sample)
                elif not queued:
                    waiting.put_back(sample, now)
                else:
                    break  # its waiting samples stay queued
        return chosen

    def yields_to_newcomer(self, request: Generation, newcomer_priority: float, now: float) -> bool:
        return self.priority(request, now) > newcomer_priority

    def _batch_s(self, per_bucket: dict[int, int], adding: int) -> float:
        """A step's estimated seconds with one more sample in bucket ``adding`` (one denoiser call per bucket)."""
        total = 0.0
        for bucket in {*per_bucket, adding}:
            step = self.cost.step_s(bucket, per_bucket.get(bucket, 0) + (bucket == adding))
            total += step if step is not None else 0.0
        return total


POLICIES: dict[str, type[SchedulingPolicy]] = {policy.name: policy for policy in (LeastWorkFirst, FirstComeFirstServed)}


def make_policy(name: str, cost: CostModel, max_batch: int) -> SchedulingPolicy:
    if name not in POLICIES:
        raise ValueError(f"policy={name!r} is unknown; allowed: {', '.join(POLICIES)}")
    return POLICIES[name](cost, max_batch)
