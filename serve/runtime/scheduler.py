"""Step-level continuous batching for generation, in three roles (as vLLM v1 splits them):

  decide   ``policy``: which samples run the next step (``LeastWorkFirst``, ``FirstComeFirstServed``),
           with ``admission`` pricing a request against its deadline before it is queued;
  execute  ``executor``: one denoiser call per length bucket, then the sampling engine's ``advance``;
  deliver  ``delivery``: previews, and each finished request decoded and answered.

The denoiser takes one t per sample, so samples at different steps, with different samplers, step
counts and lengths, share one denoiser call. With ``policy="continuous"`` new samples join the
running batch at the next step and finished ones leave at once; ``policy="static"`` admits a batch
only when the previous one has fully finished (the baseline that continuous batching must beat).

Every sample keeps its own state in the sampling engine (ldlm/sampling/loop.py), so a request gets
exactly the tokens ``LDLMPipeline.generate`` gives it, whatever else shares its batches. Every
submitted request gets exactly one answer: its result, or the exception that stopped it.

Per request, optionally: a prompt's latents to condition on by prefix inpainting, and a preview hook
that gets each sample's current x0_hat decoded every k steps: every due preview of a step, across
requests and samples, in one decoder call (``delivery``, which says when a preview is dropped).
Cancelling a request's future frees its slots at the next step; that is how a client that went away
stops its generation.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Literal

from torch import Tensor

from ldlm.pipeline import LDLMPipeline, TextResult
from ldlm.sampling import DenoiseFn, GenerateRequest, RequestLimits, SamplingEngine, SamplingPlan, resolve
from ldlm.sampling.loop import FusedStepFn
from ldlm.sampling.tokens import TokenSampling
from ldlm.serve.runtime.admission import Admission
from ldlm.serve.runtime.cost import CostModel
from ldlm.serve.runtime.delivery import Delivery, PreviewDecodes, PreviewObserver, PreviewShares, decode_ragged
from ldlm.serve.runtime.executor import StepExecutor, StepObserver
from ldlm.serve.runtime.generation import Generation, PreviewHook, Sample, WaitingQueue
from ldlm.serve.runtime.policy import make_policy
from ldlm.serve.runtime.queueing import QueueFullError, QueueWorker, resolve_future
from ldlm.serve.runtime.tracing import GenerationMarks

Policy = Literal["continuous", "static"]
__all__ = ["GenerateRequest", "GenerationScheduler", "Policy", "PreviewHook", "PreviewShares", "decode_ragged"]


class GenerationScheduler(QueueWorker):
    def __init__(
        self,
        pipeline: LDLMPipeline,
        max_batch: int = 16,
        policy: Policy = "continuous",
        max_queue: int = 4096,
        start: bool = True,
        observer: StepObserver | None = None,
        on_drop: Callable[[int], None] | None = None,
        engine: SamplingEngine | None = None,
        denoise: DenoiseFn | None = None,
        limits: RequestLimits | None = None,
        previews: PreviewShares | None = None,
        on_previews: PreviewObserver | None = None,
        fused: FusedStepFn | None = None,
        max_queue_source: str = "",
    ) -> None:
        """``pipeline`` resolves requests against its config, encodes nothing and decodes the finished
        samples and the previews; ``engine`` and ``denoise`` (default: the pipeline's) are where the steps
        run, e.g. the graphs' device while the pipeline decodes through the server's batchers. ``limits``:
        the caps every request is resolved under (a server's max_n and max_steps). ``previews``: the share of
        wall time decoding previews may take (delivery.py); ``on_previews``: told of every preview call and drop.
        ``fused``: the denoiser's fused steps, where its graph has them (``StepExecutor``). ``max_queue_source``:
        how the owner's user set ``max_queue`` (samples), for a full queue's message to name, e.g. a server's
        "--max-queue 2 requests x 16 samples": the user never typed the number of samples."""
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} is out of range; allowed: >= 1")
        self.pipeline = pipeline
        self.limits = limits or RequestLimits()
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_queue_source = max_queue_source
        cost = CostModel(max_batch)
        self.policy = make_policy(policy, cost, max_batch)
        self.admission = Admission(cost, self.policy)
        self.engine = engine or pipeline.engine
        self.executor = StepExecutor(self.engine, denoise or pipeline.graphs.denoise, pipeline.bucket_length, cost, observer, fused)
        self.delivery = Delivery(self.engine, pipeline, PreviewDecodes(pipeline, previews, on_previews))
        self._waiting = WaitingQueue()
        self._active: dict[int, Sample] = {}  # the running samples, by id, in the order the policy chose them
        self._requests: dict[int, Generation] = {}  # every request in flight (running or waiting), by id
        self._ended: deque[Generation] = deque()  # answered requests (done callbacks, any thread): the loop drops them
        self._traced: dict[int, Generation] = {}  # traced requests in flight: only they are marked at each step
        self._submitted = 0
        self.on_drop = on_drop  # samples of a cancelled or failed request dropped unfinished, for metrics
        self.dropped_samples = 0
        super().__init__("ldlm-generation", start)

    def _queue_full(self, asked: int) -> str:
        """A full queue, in the numbers of the setting that bounds it."""
        source = f" ({self.max_queue_source})" if self.max_queue_source else ""
        return (
            f"generation queue is full: {self._waiting.count} samples waiting and {asked} asked, max {self.max_queue} samples{source}; "
            "retry later, or raise the limit"
        )

    # --- public API --------------------------------------------------------------------------

    def submit(
        self,
        spec: GenerateRequest,
        prefix: Tensor | None = None,
        on_preview: PreviewHook | None = None,
        preview_every: int = 0,
        deadline_s: float | None = None,
        decoding: TokenSampling | None = None,
        trace: GenerationMarks | None = None,
    ) -> Future[TextResult]:
        """Queue a request; bad input raises here, at once, with the sampling engine's messages.

        ``prefix`` (P, D), P < length: condition every sample on these latents at its first P
        positions. ``on_preview``: gets the request's previews of every ``preview_every``-th step (not
        the last), decoded, in step order and before its answer (delivery.py: when one is dropped).
        ``deadline_s``: refuse the request now if it is estimated to take longer (see ``admission``).
        ``decoding``: a temperature, nucleus, seed and log-probabilities for its tokens (default: argmax).
        ``trace``: marks to set as the request passes queue, slot, steps and decode (tracing.py; None: untraced)."""
        plan = self.plan(spec)
        if preview_every < 0:
            raise ValueError(f"preview_every={preview_every} is out of range; allowed: >= 0 (0: no previews)")
        states = self.engine.start(plan, self.pipeline.config.d_model, prefix)
        preview_every = preview_every if on_preview else 0
        for state in states:
            state.watch = preview_every
        request = Generation(
            spec,
            plan,
            Future(),
            [None] * plan.n,
            plan.n,
            on_preview=on_preview,
            preview_every=preview_every,
            decoding=decoding,
            trace=trace,
        )
        request.samples = [Sample(request, i, state) for i, state in enumerate(states)]
        with self._cond:
            self._check_open("the scheduler")
            if self._waiting.count + plan.n > self.max_queue:
                self._count_drops(self._waiting.drop_done())  # cancelled requests' samples do not hold queue places
            if self._waiting.count + plan.n > self.max_queue:
                raise QueueFullError(self._queue_full(plan.n))
            self._submitted += 1
            request.order = self._submitted
            request.bucket = self.pipeline.bucket_length(plan.length)
            self.admission.price(request, deadline_s, self._live())
            self._waiting.add(request, request.samples)
            self._requests[id(request)] = request
            if trace is not None:
                trace.plan = {**plan.summary(), "n": plan.n, "length": plan.length}
                trace.queued = time.perf_counter()
                self._traced[id(request)] = request
            self._cond.notify()
        request.future.add_done_callback(lambda _, request=request: self._ended.append(request))  # type: ignore[misc]
        return request.future

    def plan(self, spec: GenerateRequest) -> SamplingPlan:
        """What ``spec`` would run: resolved against the pipeline's config, tuned grids and this scheduler's limits."""
        return resolve(spec, self.pipeline.config, self.limits, schedules=self.pipeline.schedules)

    def generate(self, spec: GenerateRequest, timeout_s: float | None = None) -> TextResult:
        return self.submit(spec).result(timeout_s)

    @property
    def queued_samples(self) -> int:
        return self._waiting.count

    @property
    def active_samples(self) -> int:
        return len(self._active)

    @property
    def cost(self) -> CostModel:
        """The measured step cost that policy, admission and executor share (replaceable, e.g. by a fixed one)."""
        return self.admission.cost

    @cost.setter
    def cost(self, cost: CostModel) -> None:
        self.policy.cost = self.admission.cost = self.executor.cost = cost

    @property
    def denoiser_calls(self) -> int:
        return self.executor.denoiser_calls

    @property
    def samples_stepped(self) -> int:
        return self.executor.samples_stepped

    def estimate_s(self, spec: GenerateRequest) -> tuple[float, float] | None:
        """(seconds of work that would run before ``spec``, ``spec``'s own time alone), or None before any step was measured."""
        plan = self.plan(spec)
        with self._cond:
            bucket = self.pipeline.bucket_length(plan.length)
            solo_s = self.cost.solo_s(plan.n, plan.steps, bucket)
            return self.admission.estimate(plan.n * plan.steps, bucket, solo_s, self._live(), time.perf_counter())

    def close(self, timeout_s: float | None = None) -> None:
        """Answer everything queued or running (QueueWorker.close); the worker stops delivery's threads after its last
        step. A close that stops waiting at ``timeout_s`` leaves the worker to finish: what still runs is answered."""
        super().close(timeout_s)

    # --- the worker ----------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                try:
                    if not self._serve_once():
                        return
                except Exception as error:  # deciding, admitting or releasing failed: every request in flight gets it, none hangs
                    with self._cond:
                        for request in self._live():
                            resolve_future(request.future, error=error)
                        self._active = {}  # their samples leave (and give their slots up) through _drop_done
        finally:
            self.delivery.close()  # its answers and previews go out first

    def _serve_once(self) -> bool:
        """Decide, execute and deliver one step; False once stopping with nothing left to answer."""
        with self._cond:
            while not self._waiting.count and not self._active and not self._stopping:
                self._cond.wait()
            if self._stopping and not self._waiting.count and not self._active:
                return False
            self._drop_done()  # a request that was cancelled or timed out frees its slots at once
            if self._waiting:  # otherwise the running set stands: nothing to decide
                running = list(self._active.values())
                chosen = self.policy.select(running, self._waiting, time.perf_counter())
                if chosen is not running:  # a policy hands back the list it was given when nothing changes
                    self._active = {id(s): s for s in chosen}
                    self.executor.run(chosen)
            if not self._active:
                return True
            alone = len(self._requests) == 1  # the previewed request is the only generation in flight
            traced = list(self._traced.values()) if self._traced else ()  # a copy: submit adds to it under the lock
        try:
            step = self.executor.execute()
            if traced:
                self._mark_step(traced)
            for sample in step.finished:
                del self._active[id(sample)]
            self.delivery.previews(step.due, alone)
            self.delivery.finish(step.finished)
            for sample in step.finished:  # a request whose samples all finished is being answered: not in flight here
                if sample.request.remaining == 0:
                    self._requests.pop(id(sample.request), None)
        except Exception as error:  # every request in the batch gets the error, none hangs
            batch = list(self._active.values())
            for sample in batch:
                resolve_future(sample.request.future, error=error)
            self.executor.release(batch)
            self._active = {}
        return True

    def _mark_step(self, traced: Sequence[Generation]) -> None:
        """After a step, before its finished samples leave: each ``traced`` request that ran in it marks it (tracing.py)."""
        ended, size = time.perf_counter(), len(self._active)
        for request in traced:
            if any(id(sample) in self._active for sample in request.samples):
                request.trace.step(size, ended)  # type: ignore[union-attr]
                request.trace.started = request.trace.started or request.started  # type: ignore[union-attr]

    def _live(self) -> list[Generation]:
        """Every request with a sample running or waiting (under the lock)."""
        return [r for r in self._requests.values() if not r.future.done()]

    def _drop_done(self) -> None:
        """Requests answered since the last step (finished, cancelled, timed out, failed) leave: the samples of
        those that ended early leave the batch and the queue and give their slots up. Work per ended request,
        none per running sample."""
        dropped = self._waiting.drop_done() if self._ended else 0
        while self._ended:
            request = self._ended.popleft()
            self._requests.pop(id(request), None)
            self._traced.pop(id(request), None)
            running = [s for s in request.samples if self._active.pop(id(s), None) is not None]
            dropped += len(running)
            self.executor.release(request.samples)
        self._count_drops(dropped)

    def _count_drops(self, dropped: int) -> None:
        if dropped:
            self.dropped_samples += dropped
            if self.on_drop is not None:
                self.on_drop(dropped)
