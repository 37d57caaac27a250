"""Step-level continuous batching for generation.

The denoiser takes one t per sample, so samples at different steps, with different step counts
and lengths, share one denoiser call. With ``policy="continuous"`` new samples join the running
batch at the next step and finished ones leave at once; ``policy="static"`` admits a batch only
when the previous one has fully finished (the baseline that continuous batching must beat).

Every sample keeps its own noise stream, time grid and self-conditioning state, so a request gets
exactly the tokens ``LDLMPipeline.generate`` gives it, whatever else shares its batches. Every
submitted request gets exactly one answer: its result, or the exception that stopped it.

State lives on the pipeline's device: grids, noise streams, x and self-conditioning, so a step
makes no host round trip; only finished samples' latents go to the decoder.

Per request, optionally: a prompt's latents to condition on by prefix inpainting (see
``LDLMPipeline.inpaint_prefix``), and a preview hook called every k steps with each sample's
current x0_hat. The hook runs on the worker thread, so it must only hand the tensor on (decoding
belongs elsewhere, or every other request would wait for it). Cancelling a request's future frees
its slots at the next step; that is how a client that went away stops its generation.

Order (``policy="continuous"``): at every step the batch holds the samples of the requests with the
least remaining work (shortest remaining work first, priced in seconds by the measured
``CostModel``), so a short request that arrives while long ones fill the batch joins at the next
step, taking a slot from the request with the most work left. That sample is not set back: its
state (x, self-conditioning, solver history, noise stream) stays with it and it resumes where it
stopped, with the same tokens. The first request in that order gets no more company than keeps its
step within ``LEAD_SLOWDOWN`` of its step alone (where a step's cost grows with its batch, as on a
CPU, a short request runs nearly alone for its few steps). Nothing starves: a request that has
waited longer than its own time alone gains priority with every further second it waits, until it
outranks any newcomer. ``policy="static"`` keeps first come, first served.

Admission (with ``deadline_s``): the estimated time of a request, its own time plus the work of
every request that would run before it, must fit its deadline, or ``submit`` refuses it at once
(``cost.RequestTooLargeError`` if it could not fit even alone, else
``cost.DeadlineUnreachableError`` with a time to retry), naming the estimate and the limit.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ldlm.pipeline import LDLMPipeline, TextResult
from ldlm.sampler import NoiseStream, sample_seeds, to_device
from ldlm.serve.runtime.cost import CostModel, DeadlineUnreachableError, RequestTooLargeError
from ldlm.serve.runtime.queueing import QueueFullError, QueueWorker, resolve_future
from ldlm.solvers import Solver, get_solver, push_past

log = logging.getLogger("ldlm.serve")
Policy = Literal["continuous", "static"]
PreviewHook = Callable[[int, int, Tensor], None]  # (sample index, steps done, x0_hat (L, D)); must not block


# A step of the request with the least work left is at most this much slower than the step it would
# take alone: where a step's cost grows with its batch (a CPU, a saturated GPU) a short request then
# runs with little company, and where batching is nearly free (a GPU below its limit) the batch fills.
# 2, measured on the 2-core CPU (scripts/fairness.py, docs/measurements/fairness-2026-12-01.json): at 3
# the 8-step requests' p99 beside 1000-step ones rose past 3x their p99 alone for ~4% more long throughput.
LEAD_SLOWDOWN = 2.0


@dataclass(frozen=True)
class GenerateRequest:
    n: int
    length: int
    steps: int
    seed: int = 0
    sampler: str | None = None  # None: the config's default_sampler
    t_min: float | None = None


@dataclass
class _Request:
    spec: GenerateRequest
    future: Future[TextResult]
    latents: list[Tensor | None]
    remaining: int
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    prefix: Tensor | None = None  # (P, D) prompt latents to inpaint
    on_preview: PreviewHook | None = None
    preview_every: int = 0
    # the scheduler's bookkeeping for order and admission (set when queued)
    order: int = 0  # submission order: ties, and the static policy
    bucket: int = 0  # the length bucket its samples run in
    work: int = 0  # sample-steps left (n x steps at submit)
    solo_s: float | None = None  # its time alone, as estimated at submit
    waited_s: float = 0.0  # time with some sample waiting for a slot, before waiting_since
    waiting_since: float | None = None


@dataclass
class _Sample:
    request: _Request
    index: int
    solver: Solver
    grid: Tensor  # (steps + 1,) float32 on the pipeline's device
    stream: NoiseStream
    x: Tensor  # (L, D)
    x_mean: Tensor
    x0_hat: Tensor  # the denoiser's last output (previews, decode_final="x0")
    x0_prev: Tensor  # the self-conditioning input of the next denoiser call
    past: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # the solver's (x0_hat (L, D), lambda ()), newest first
    step: int = 0
    prefix_noise: NoiseStream | None = None  # the forward noise of the inpainted prefix


class GenerationScheduler(QueueWorker):
    def __init__(
        self,
        pipeline: LDLMPipeline,
        max_batch: int = 16,
        policy: Policy = "continuous",
        max_queue: int = 4096,
        start: bool = True,
        observer: Callable[[int, float, float], None] | None = None,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} is out of range; allowed: >= 1")
        if policy not in ("continuous", "static"):
            raise ValueError(f"policy={policy!r} is unknown; allowed: continuous, static")
        self.pipeline = pipeline
        self.max_batch = max_batch
        self.policy = policy
        self.max_queue = max_queue
        # waiting samples, per request (in submission order): id(request) -> (request, its samples in index order)
        self._waiting: dict[int, tuple[_Request, deque[_Sample]]] = {}
        self._queued = 0
        self._submitted = 0
        self.cost = CostModel(max_batch)
        self.on_drop = on_drop  # samples of a cancelled or failed request dropped unfinished, for metrics
        self.dropped_samples = 0
        self._active: list[_Sample] = []
        self.observer = observer  # (batch size, 0, compute seconds) per denoiser call, for metrics
        self.denoiser_calls = 0
        self._missing = torch.tensor(float("nan"), dtype=torch.float64, device=pipeline.device)  # a past step not taken
        self.samples_stepped = 0
        super().__init__("ldlm-generation", start)

    # --- public API --------------------------------------------------------------------------

    def submit(
        self,
        spec: GenerateRequest,
        prefix: Tensor | None = None,
        on_preview: PreviewHook | None = None,
        preview_every: int = 0,
        deadline_s: float | None = None,
    ) -> Future[TextResult]:
        """Queue a request; bad input raises here, at once, with the pipeline's messages.

        ``prefix`` (P, D), P < length: condition every sample on these latents at its first P
        positions. ``on_preview``: called every ``preview_every`` steps (not after the last).
        ``deadline_s``: refuse the request now if it is estimated to take longer (see the module docs)."""
        cfg = self.pipeline.config
        if not isinstance(spec.n, int) or spec.n < 1:
            raise ValueError(f"n={spec.n!r} is out of range; allowed: an integer >= 1")
        self.pipeline.check_length(spec.length)
        solver = get_solver(cfg.default_sampler if spec.sampler is None else spec.sampler)
        t_min = cfg.t_min if spec.t_min is None else spec.t_min
        grid = to_device(solver.time_grid(spec.steps, t_min, self.pipeline.schedule).float(), self.pipeline.device)
        if prefix is not None and not (prefix.ndim == 2 and prefix.shape[0] < spec.length and prefix.shape[1] == cfg.d_model):
            raise ValueError(f"prefix has shape {tuple(prefix.shape)}; allowed: (P, {cfg.d_model}) with P < length={spec.length}")
        if preview_every < 0:
            raise ValueError(f"preview_every={preview_every} is out of range; allowed: >= 0 (0: no previews)")
        request = _Request(
            spec,
            Future(),
            [None] * spec.n,
            spec.n,
            prefix=None if prefix is None else prefix.to(self.pipeline.device),
            on_preview=on_preview,
            preview_every=preview_every if on_preview is not None else 0,
        )
        samples = []
        for i, seed in enumerate(sample_seeds(spec.seed, spec.n)):
            stream = NoiseStream(seed, (spec.length, cfg.d_model), self.pipeline.noise_device)
            prior = stream.draw().to(self.pipeline.device)
            prefix_noise = None if prefix is None else NoiseStream(seed ^ 1, tuple(prefix.shape), self.pipeline.noise_device)
            zeros = torch.zeros_like(prior)
            samples.append(_Sample(request, i, solver, grid, stream, prior, prior, zeros, zeros, prefix_noise=prefix_noise))
        with self._cond:
            self._check_open("the scheduler")
            if self._queued + len(samples) > self.max_queue:
                self._drop_done()  # cancelled requests' samples do not hold queue places
            if self._queued + len(samples) > self.max_queue:
                raise QueueFullError(f"generation queue is full ({self._queued} samples waiting, max {self.max_queue})")
            self._book(request, len(grid) - 1, deadline_s)
            self._waiting[id(request)] = (request, deque(samples))
            self._queued += len(samples)
            request.waiting_since = request.submitted
            self._cond.notify()
        return request.future

    def generate(self, spec: GenerateRequest, timeout_s: float | None = None) -> TextResult:
        return self.submit(spec).result(timeout_s)

    @property
    def queued_samples(self) -> int:
        return self._queued

    @property
    def active_samples(self) -> int:
        return len(self._active)

    def estimate_s(self, spec: GenerateRequest) -> tuple[float, float] | None:
        """(seconds of work that would run before ``spec``, ``spec``'s own time alone), or None before any step was measured."""
        with self._cond:
            bucket = self.pipeline.bucket_length(spec.length)
            return self._estimate(spec.n * spec.steps, bucket, self.cost.solo_s(spec.n, spec.steps, bucket), time.perf_counter())

    # --- the worker ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queued and not self._active and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._queued and not self._active:
                    return
                self._drop_done()  # a request that was cancelled or timed out frees its slots at once
                self._admit()
                if not self._active:
                    continue
            batch = list(self._active)
            try:
                # One denoiser call per length bucket: padding a 16-token sample to 128 would cost
                # more than the extra call.
                buckets: dict[int, list[_Sample]] = {}
                for sample in batch:
                    buckets.setdefault(self.pipeline.bucket_length(sample.x.shape[0]), []).append(sample)
                finished = []
                for bucket, group in buckets.items():
                    started = time.perf_counter()
                    finished += self._step(group)
                    self.cost.observe(bucket, len(group), time.perf_counter() - started)
                    for sample in group:
                        sample.request.work -= 1
                if finished:
                    self._finish(finished)
            except Exception as error:  # every request in the batch gets the error, none hangs
                for sample in batch:
                    resolve_future(sample.request.future, error=error)
                self._active = [s for s in self._active if s not in batch]

    def _admit(self) -> None:
        """Fill the batch for the next step: first come first served (static, once the batch is empty),
        else the samples of the requests with the least remaining work, taking slots from the most,
        with no more company than keeps the first request's step within ``LEAD_SLOWDOWN`` of its step alone."""
        if not self._waiting or (self.policy == "static" and self._active):
            return
        now = time.perf_counter()
        if self.policy == "static":
            for request, queued in sorted(self._waiting.values(), key=lambda entry: entry[0].order):
                while queued and len(self._active) < self.max_batch:
                    self._take(request, queued, now)
            return
        requests = {id(s.request): s.request for s in self._active}
        requests.update((key, request) for key, (request, _) in self._waiting.items())
        ranked = sorted(requests.values(), key=lambda r: (self._priority(r, now), r.order))
        running: dict[int, list[_Sample]] = {}
        for sample in self._active:
            running.setdefault(id(sample.request), []).append(sample)
        lead = ranked[0]
        lead_samples = len(running.get(id(lead), ())) + len(self._waiting.get(id(lead), (None, ()))[1])
        alone = self.cost.step_s(lead.bucket, min(lead_samples, self.max_batch))
        limit = math.inf if alone is None else LEAD_SLOWDOWN * alone
        chosen: list[_Sample] = []
        per_bucket: dict[int, int] = {}
        for request in ranked:
            candidates = [(sample, False) for sample in running.get(id(request), [])]  # its running samples first
            entry = self._waiting.get(id(request))
            candidates += [(sample, True) for sample in (entry[1] if entry is not None else ())]
            for sample, waiting in candidates:
                fits = len(chosen) < self.max_batch and (request is lead or self._batch_s(per_bucket, request.bucket) <= limit)
                if fits:
                    per_bucket[request.bucket] = per_bucket.get(request.bucket, 0) + 1
                    chosen.append(self._take(request, entry[1], now, activate=False) if waiting else sample)  # type: ignore[index]
                elif not waiting:
                    self._put_back(sample, now)
                else:
                    break  # its waiting samples stay queued
        self._active = chosen

    def _batch_s(self, per_bucket: dict[int, int], adding: int) -> float:
        """A step's estimated seconds with one more sample in bucket ``adding`` (one denoiser call per bucket)."""
        total = 0.0
        for bucket in {*per_bucket, adding}:
            step = self.cost.step_s(bucket, per_bucket.get(bucket, 0) + (bucket == adding))
            total += step if step is not None else 0.0
        return total

    def _take(self, request: _Request, waiting: deque[_Sample], now: float, activate: bool = True) -> _Sample:
        """The next waiting sample of ``request`` leaves the queue (into the batch when ``activate``)."""
        sample = waiting.popleft()
        self._queued -= 1
        if not waiting:  # none of it waits any more
            del self._waiting[id(request)]
            request.waited_s += now - (request.waiting_since or now)
            request.waiting_since = None
        request.started = request.started or now
        if activate:
            self._active.append(sample)
        return sample

    def _put_back(self, sample: _Sample, now: float) -> None:
        """A running sample gives its slot to a request with less work left; it resumes where it stopped."""
        request = sample.request
        entry = self._waiting.setdefault(id(request), (request, deque()))
        entry[1].appendleft(sample)  # first of its request's waiting samples (its index order is kept)
        self._queued += 1
        if request.waiting_since is None:
            request.waiting_since = now

    def _priority(self, request: _Request, now: float) -> float:
        """Seconds of work left, less one second for every second waited beyond its own time alone."""
        price = self.cost.sample_step_s(request.bucket)
        left = request.work * (price if price is not None else request.bucket * 1e-6)
        waited = request.waited_s + (now - request.waiting_since if request.waiting_since is not None else 0.0)
        grace = request.solo_s if request.solo_s is not None else 1.0
        return left - max(0.0, waited - grace)

    def _drop_done(self) -> None:
        """Samples of requests already answered (cancelled, timed out, failed) leave the batch and the queue."""
        dropped = len(self._active)
        self._active = [s for s in self._active if not s.request.future.done()]
        dropped -= len(self._active)
        for key, (request, waiting) in list(self._waiting.items()):
            if request.future.done():
                del self._waiting[key]
                self._queued -= len(waiting)
                dropped += len(waiting)
        if dropped:
            self.dropped_samples += dropped
            if self.on_drop is not None:
                self.on_drop(dropped)

    def _book(self, request: _Request, steps: int, deadline_s: float | None) -> None:
        """A new request's order, price and admission (under the lock, before it is queued)."""
        spec = request.spec
        self._submitted += 1
        request.order, request.work = self._submitted, spec.n * steps
        request.bucket = self.pipeline.bucket_length(spec.length)
        request.solo_s = self.cost.solo_s(spec.n, steps, request.bucket)
        if deadline_s is None or request.solo_s is None:
            return  # nothing measured yet: nothing is refused on a guess
        what = f"{spec.n} sample{'s' if spec.n > 1 else ''} x {steps} steps at length {spec.length}"
        if request.solo_s > deadline_s:
            raise RequestTooLargeError(
                f"this request ({what}) is estimated at {request.solo_s:.1f} s even on an idle server, and its deadline is "
                f"{deadline_s:.1f} s; allowed: requests estimated within the deadline (fewer samples or steps)"
            )
        ahead, own = self._estimate(request.work, request.bucket, request.solo_s, request.submitted)  # type: ignore[misc]
        if ahead + own > deadline_s:
            raise DeadlineUnreachableError(
                f"this request ({what}) is estimated at {ahead + own:.1f} s ({ahead:.1f} s of work queued ahead of it + "
                f"{own:.1f} s of its own), beyond its deadline of {deadline_s:.1f} s; retry in {math.ceil(ahead)} s",
                retry_after_s=max(1.0, ahead),
            )

    def _estimate(self, work: int, bucket: int, solo_s: float | None, now: float) -> tuple[float, float] | None:
        """(seconds of the work that runs first, the request's own time): the work ahead is what every live
        request with less work left (or more waited, see ``_priority``) still has, at full batches."""
        if solo_s is None:
            return None
        price = self.cost.sample_step_s(bucket) or 0.0
        mine = work * price  # what _priority would say of the new request
        live = {id(s.request): s.request for s in self._active}
        live.update((key, request) for key, (request, _) in self._waiting.items())
        ahead = 0.0
        for request in live.values():
            if request.future.done() or (self.policy == "continuous" and self._priority(request, now) > mine):
                continue  # answered, or it yields to the new request
            ahead += request.work * (self.cost.sample_step_s(request.bucket) or 0.0)
        return ahead, solo_s

    @torch.inference_mode()
    def _step(self, batch: list[_Sample]) -> list[_Sample]:
        """One denoiser call for every active sample, then each sample's own solver step."""
        pipe = self.pipeline
        lengths = [s.x.shape[0] for s in batch]
        padded = pipe.bucket_length(max(lengths))
        for sample in batch:
            if sample.request.prefix is not None:  # t stays a device tensor: no host round trip
                sample.x = pipe.inpaint_prefix(
                    sample.x,
                    sample.grid[sample.step],
                    sample.request.prefix,
                    sample.prefix_noise.draw().to(pipe.device),  # type: ignore[union-attr]
                )

        def stack(tensors: list[Tensor]) -> Tensor:
            return torch.stack([F.pad(t, (0, 0, 0, padded - t.shape[0])) for t in tensors]).to(pipe.device)

        mask = torch.zeros(len(batch), padded, dtype=torch.bool, device=pipe.device)
        for i, n in enumerate(lengths):
            mask[i, :n] = True
        t = torch.stack([s.grid[s.step] for s in batch])  # device tensors: no host round trip
        t_next = torch.stack([s.grid[s.step + 1] for s in batch])
        x = stack([s.x for s in batch])
        started = time.perf_counter()
        x0_hat = pipe.graphs.denoise(x, t, stack([s.x0_prev for s in batch]), mask)
        if self.observer is not None:
            self.observer(len(batch), 0.0, time.perf_counter() - started)
        self.denoiser_calls += 1
        self.samples_stepped += len(batch)
        # One solver step per solver in the batch, each over its own rows and their own pasts.
        by_solver: dict[str, list[int]] = {}
        for i, sample in enumerate(batch):
            by_solver.setdefault(sample.solver.name, []).append(i)
        for rows in by_solver.values():
            index = slice(None) if len(by_solver) == 1 else to_device(torch.tensor(rows), pipe.device)
            self._solver_step([batch[i] for i in rows], index, x, x0_hat, t, t_next, stack)
        finished = []
        for sample in batch:
            sample.step += 1
            if sample.step == len(sample.grid) - 1:
                finished.append(sample)
            elif sample.request.preview_every and sample.step % sample.request.preview_every == 0:
                try:
                    sample.request.on_preview(sample.index, sample.step, sample.x0_hat)  # type: ignore[misc]
                except Exception as error:  # a broken hook ends its own request, with its error, never the batch
                    log.exception("preview hook failed; its request ends with the error")
                    resolve_future(sample.request.future, error=error)
        return finished

    def _solver_step(
        self,
        group: list[_Sample],
        rows: Tensor | slice,
        x: Tensor,
        x0_hat: Tensor,
        t: Tensor,
        t_next: Tensor,
        stack: Callable[[list[Tensor]], Tensor],
    ) -> None:
        """The solver step of the samples in ``group`` (one solver; their rows of the batch)."""
        solver, schedule = group[0].solver, self.pipeline.schedule
        x_g, x0_g, t_g, t_next_g = x[rows], x0_hat[rows], t[rows], t_next[rows]
        past = []
        for k in range(solver.history):  # a sample with fewer past steps gets a missing (NaN) lambda there
            past.append(
                (
                    stack([s.past[k][0] if k < len(s.past) else torch.zeros_like(s.x) for s in group]),
                    torch.stack([s.past[k][1] if k < len(s.past) else self._missing for s in group]),
                )
            )
        noise = stack([s.stream.draw() for s in group]) if solver.stochastic else None
        result = solver.step(schedule, x_g, x0_g, t_g, t_next_g, past, noise)
        lam = schedule.log_snr(t_g) if solver.history else None
        for i, sample in enumerate(group):
            n = sample.x.shape[0]
            sample.x, sample.x_mean = result.x[i, :n], result.x_mean[i, :n]
            sample.x0_hat, sample.x0_prev = x0_g[i, :n], result.x0_prev[i, :n]
            if lam is not None:
                sample.past = push_past(sample.past, sample.x0_hat, lam[i], solver.history)

    def _finish(self, finished: list[_Sample]) -> None:
        """Record finished samples; decode every request they complete in one decoder call."""
        self._active = [s for s in self._active if s not in finished]
        final = self.pipeline.config.decode_final
        complete: list[_Request] = []
        for sample in finished:
            request = sample.request
            latent = sample.x_mean if final == "mean" else sample.x0_hat
            if request.prefix is not None:  # the prompt's positions end exactly at the prompt
                latent = torch.cat([request.prefix.to(latent.dtype), latent[request.prefix.shape[0] :]])
            request.latents[sample.index] = latent
            request.remaining -= 1
            if request.remaining == 0 and not request.future.done():
                complete.append(request)
        if not complete:
            return
        decoded = decode_ragged(self.pipeline, [z for r in complete for z in r.latents])  # type: ignore[misc]
        start = 0
        for request in complete:
            n, length = request.spec.n, request.spec.length
            rows = slice(start, start + n)
            resolve_future(request.future, TextResult(decoded.token_ids[rows, :length], decoded.texts[rows], decoded.lengths[rows]))
            start += n


def decode_ragged(pipeline: LDLMPipeline, latents: list[Tensor]) -> TextResult:
    """Latents of different lengths, each (L_i, D), in one decoder call: right-padded to the longest,
    the padding masked; each row's ``lengths`` entry is its own L_i."""
    longest = max(z.shape[0] for z in latents)
    mask = torch.zeros(len(latents), longest, dtype=torch.bool)
    for i, z in enumerate(latents):
        mask[i, : z.shape[0]] = True
    return pipeline.decode(torch.stack([F.pad(z, (0, 0, 0, longest - z.shape[0])) for z in latents]), mask)
