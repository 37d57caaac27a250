"""What the generation scheduler holds: requests in flight, their samples, and the samples waiting
for a slot. Plain bookkeeping; deciding (``policy``), executing (``executor``) and delivering
(``delivery``) live in their own modules."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from torch import Tensor

from ldlm.pipeline import TextResult
from ldlm.sampling import GenerateRequest, SampleState, SamplingPlan
from ldlm.sampling.tokens import TokenSampling
from ldlm.serve.runtime.tracing import GenerationMarks


@dataclass(frozen=True)
class Preview:
    """One sample's x0_hat after ``step`` steps, decoded: its token ids (its own length) and their text."""

    index: int
    step: int
    token_ids: list[int]
    text: str


PreviewHook = Callable[[list[Preview]], None]  # one step's previews of a request, in sample order; must not block


@dataclass(eq=False)
class Generation:
    """One request in flight: its plan, its answer, and the scheduler's bookkeeping for order and admission."""

    spec: GenerateRequest
    plan: SamplingPlan
    future: Future[TextResult]
    latents: list[Tensor | None]  # each sample's final latent, as it finishes
    remaining: int  # samples not finished
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    on_preview: PreviewHook | None = None
    preview_every: int = 0
    decoding: TokenSampling | None = None  # how its tokens are chosen from the decoder's logits (None: argmax)
    order: int = 0  # submission order: ties, and first come first served
    bucket: int = 0  # the length bucket its samples run in
    samples: list[Sample] = field(default_factory=list)
    solo_s: float | None = None  # its time alone, as estimated at submit
    waited_s: float = 0.0  # time with some sample waiting for a slot, before waiting_since
    waiting_since: float | None = None
    trace: GenerationMarks | None = None  # where a traced request's marks go (None: not traced, nothing is marked)

    @property
    def work(self) -> int:
        """Sample-steps left: read off its samples' step counters when a decision needs it, never counted per step."""
        return sum(self.plan.steps - s.state.step for s in self.samples)


@dataclass(eq=False)
class Sample:
    """One sample of a request: its index in the request and its sampling state."""

    request: Generation
    index: int
    state: SampleState


class WaitingQueue:
    """The samples waiting for a slot, per request in submission order, each request's in index order."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Generation, deque[Sample]]] = {}
        self.count = 0  # samples waiting

    def __bool__(self) -> bool:
        return bool(self._entries)

    def add(self, request: Generation, samples: list[Sample]) -> None:
        self._entries[id(request)] = (request, deque(samples))
        self.count += len(samples)
        request.waiting_since = request.submitted

    def requests(self) -> list[Generation]:
        return [request for request, _ in self._entries.values()]

    def of(self, request: Generation) -> deque[Sample]:
        """``request``'s waiting samples (empty when none waits)."""
        entry = self._entries.get(id(request))
        return entry[1] if entry is not None else deque()

    def take(self, request: Generation, now: float) -> Sample:
        """The next waiting sample of ``request`` leaves the queue."""
        waiting = self._entries[id(request)][1]
        sample = waiting.popleft()
        self.count -= 1
        if not waiting:  # none of it waits any more
            del self._entries[id(request)]
            request.waited_s += now - (request.waiting_since or now)
            request.waiting_since = None
        request.started = request.started or now
        return sample

    def put_back(self, sample: Sample, now: float) -> None:
        """A running sample gives its slot up; it resumes where it stopped, first of its request's waiting samples."""
        request = sample.request
        entry = self._entries.setdefault(id(request), (request, deque()))
        entry[1].appendleft(sample)
        self.count += 1
        if request.waiting_since is None:
            request.waiting_since = now

    def drop_done(self) -> int:
        """Samples of requests already answered (cancelled, timed out, failed) leave the queue; how many."""
        dropped = 0
        for key, (request, waiting) in list(self._entries.items()):
            if request.future.done():
                del self._entries[key]
                self.count -= len(waiting)
                dropped += len(waiting)
        return dropped
