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
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ldlm.pipeline import LDLMPipeline, TextResult
from ldlm.sampler import NoiseStream, sample_seeds, to_device
from ldlm.solvers import Solver, get_solver, push_past

log = logging.getLogger("ldlm.serve")
Policy = Literal["continuous", "static"]
PreviewHook = Callable[[int, int, Tensor], None]  # (sample index, steps done, x0_hat (L, D)); must not block


class QueueFullError(RuntimeError):
    """The scheduler's queue is at capacity; retry later."""


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


class GenerationScheduler:
    def __init__(
        self, pipeline: LDLMPipeline, max_batch: int = 16, policy: Policy = "continuous", max_queue: int = 4096,
        start: bool = True, observer: Callable[[int, float, float], None] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} is out of range; allowed: >= 1")
        if policy not in ("continuous", "static"):
            raise ValueError(f"policy={policy!r} is unknown; allowed: continuous, static")
        self.pipeline = pipeline
        self.max_batch = max_batch
        self.policy = policy
        self.max_queue = max_queue
        self._queue: deque[_Sample] = deque()
        self._active: list[_Sample] = []
        self._cond = threading.Condition()
        self._stopping = False
        self.observer = observer  # (batch size, 0, compute seconds) per denoiser call, for metrics
        self.denoiser_calls = 0
        self._missing = torch.tensor(float("nan"), dtype=torch.float64, device=pipeline.device)  # a past step not taken
        self.samples_stepped = 0
        self._thread = threading.Thread(target=self._loop, name="ldlm-generation", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        """Start the worker (when constructed with ``start=False``, e.g. to queue a known batch first)."""
        self._thread.start()

    # --- public API --------------------------------------------------------------------------

    def submit(self, spec: GenerateRequest, prefix: Tensor | None = None, on_preview: PreviewHook | None = None,
               preview_every: int = 0) -> Future[TextResult]:
        """Queue a request; bad input raises here, at once, with the pipeline's messages.

        ``prefix`` (P, D), P < length: condition every sample on these latents at its first P
        positions. ``on_preview``: called every ``preview_every`` steps (not after the last)."""
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
        request = _Request(spec, Future(), [None] * spec.n, spec.n,
                           prefix=None if prefix is None else prefix.to(self.pipeline.device), on_preview=on_preview,
                           preview_every=preview_every if on_preview is not None else 0)
        samples = []
        for i, seed in enumerate(sample_seeds(spec.seed, spec.n)):
            stream = NoiseStream(seed, (spec.length, cfg.d_model), self.pipeline.noise_device)
            prior = stream.draw().to(self.pipeline.device)
            prefix_noise = None if prefix is None else NoiseStream(seed ^ 1, tuple(prefix.shape), self.pipeline.noise_device)
            zeros = torch.zeros_like(prior)
            samples.append(_Sample(request, i, solver, grid, stream, prior, prior, zeros, zeros, prefix_noise=prefix_noise))
        with self._cond:
            if self._stopping:
                raise RuntimeError("the scheduler is shut down")
            if len(self._queue) + len(samples) > self.max_queue:
                raise QueueFullError(f"generation queue is full ({len(self._queue)} samples waiting, max {self.max_queue})")
            self._queue.extend(samples)
            self._cond.notify()
        return request.future

    def generate(self, spec: GenerateRequest, timeout_s: float | None = None) -> TextResult:
        return self.submit(spec).result(timeout_s)

    @property
    def queued_samples(self) -> int:
        return len(self._queue)

    def close(self, timeout_s: float | None = None) -> None:
        """Finish every queued and running sample, then stop the worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)

    # --- the worker ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._active and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._queue and not self._active:
                    return
                self._admit()
                # a request that was cancelled or timed out frees its slots at once
                self._active = [s for s in self._active if not s.request.future.done()]
                if not self._active:
                    continue
            batch = list(self._active)
            try:
                # One denoiser call per length bucket: padding a 16-token sample to 128 would cost
                # more than the extra call.
                buckets: dict[int, list[_Sample]] = {}
                for sample in batch:
                    buckets.setdefault(self.pipeline.bucket_length(sample.x.shape[0]), []).append(sample)
                finished = [done for group in buckets.values() for done in self._step(group)]
                if finished:
                    self._finish(finished)
            except Exception as error:  # every request in the batch gets the error, none hangs
                for sample in batch:
                    resolve_future(sample.request.future, error=error)
                self._active = [s for s in self._active if s not in batch]

    def _admit(self) -> None:
        if self.policy == "static" and self._active:
            return
        now = time.perf_counter()
        while self._queue and len(self._active) < self.max_batch:
            sample = self._queue.popleft()
            if sample.request.future.done():  # failed or cancelled: drop its other samples
                continue
            sample.request.started = sample.request.started or now
            self._active.append(sample)

    @torch.inference_mode()
    def _step(self, batch: list[_Sample]) -> list[_Sample]:
        """One denoiser call for every active sample, then each sample's own solver step."""
        pipe = self.pipeline
        lengths = [s.x.shape[0] for s in batch]
        padded = pipe.bucket_length(max(lengths))
        for sample in batch:
            if sample.request.prefix is not None:  # t stays a device tensor: no host round trip
                sample.x = pipe.inpaint_prefix(sample.x, sample.grid[sample.step], sample.request.prefix,
                                               sample.prefix_noise.draw().to(pipe.device))  # type: ignore[union-attr]

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

    def _solver_step(self, group: list[_Sample], rows: Tensor | slice, x: Tensor, x0_hat: Tensor, t: Tensor, t_next: Tensor,
                     stack: Callable[[list[Tensor]], Tensor]) -> None:
        """The solver step of the samples in ``group`` (one solver; their rows of the batch)."""
        solver, schedule = group[0].solver, self.pipeline.schedule
        x_g, x0_g, t_g, t_next_g = x[rows], x0_hat[rows], t[rows], t_next[rows]
        past = []
        for k in range(solver.history):  # a sample with fewer past steps gets a missing (NaN) lambda there
            past.append((stack([s.past[k][0] if k < len(s.past) else torch.zeros_like(s.x) for s in group]),
                         torch.stack([s.past[k][1] if k < len(s.past) else self._missing for s in group])))
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
                latent = torch.cat([request.prefix.to(latent.dtype), latent[request.prefix.shape[0]:]])
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


def resolve_future(future: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Answer a future unless its caller cancelled it meanwhile (a race the caller may win)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
