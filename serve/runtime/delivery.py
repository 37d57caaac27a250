"""Delivering what a generation step produced: previews of running samples, and the answers of
requests whose samples have all finished (the argmax ones decoded together, in one decoder call;
one that draws its tokens at a temperature decoded alone, since its settings and seed are its own).

Nothing here makes the scheduler's thread wait on the device or the decoder: it only gathers the rows to
decode (a device copy, queued) and hands them on: previews to the previews' thread, finished requests to
the answers' thread, which decodes them and answers each (a request whose previews are still being
decoded right after them, on the previews' thread). On CUDA each thread first waits for the copy's
event, so the steps go on meanwhile.

Previews (``PreviewDecodes``). After every step the samples whose request asked for previews every
``preview_every`` steps, and stand at a multiple of it below their last step, are due (``SlotTable.due``).
Every due preview of the step, of every request and sample, is decoded in one decoder call, on the
previews' own thread, while the steps go on (in a server the call goes through the decoder's batcher, which on CUDA
runs it on a stream of its own: ``GraphBackend.worker_context``); calls run in step order, each request's hook gets its previews
from that thread in step order, and a request whose previews are still being decoded when it finishes
is answered right after them. A due preview is dropped (never decoded, and counted as skipped)
exactly when:

- its request is already answered: cancelled (its client left, its time ran out) or failed; or
- its decoder call fails (logged; a preview never ends a request); or
- decoding previews is over its share of the wall time, ``s`` < 1: a call is still running, or the
  last one, of B seconds, ended less than B x (1 - s) / s seconds ago. The share is ``busy`` while
  more than one generation is in flight (queued or running) and ``alone`` while the previewed request
  is the only one. At a share of 1 (``alone``'s default) nothing is dropped for time: a request alone
  on the server gets every preview it asks for.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ldlm.limits import BUDGET, PREVIEW_BUDGET, PREVIEW_LONE_BUDGET
from ldlm.pipeline import LDLMPipeline, TextResult
from ldlm.sampling import SampleState, SamplingEngine, to_device
from ldlm.serve.runtime.generation import Generation, Preview, Sample
from ldlm.serve.runtime.queueing import resolve_future

log = logging.getLogger("ldlm.serve")

PreviewObserver = Callable[[int, int, float], None]  # (previews decoded and handed on, previews dropped, decode seconds)


@dataclass(frozen=True)
class PreviewShares:
    """The share of wall time decoding previews may take (module docs): ``busy`` beside other generations,
    ``alone`` while the previewed request is the only one; 1: no limit."""

    busy: float = PREVIEW_BUDGET
    alone: float = PREVIEW_LONE_BUDGET

    def __post_init__(self) -> None:
        BUDGET.check("preview_budget", self.busy)
        BUDGET.check("preview_lone_budget", self.alone)


_Due = tuple[Generation, int, int]  # (request, sample index, step)


class PreviewDecodes:
    """One decoder call per step for the step's due previews, on a thread of its own (module docs)."""

    def __init__(self, pipeline: LDLMPipeline, shares: PreviewShares | None = None, observer: PreviewObserver | None = None) -> None:
        self.pipeline = pipeline
        self.shares = shares or PreviewShares()
        self.observer = observer
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="ldlm-previews")
        self._pending: dict[Generation, Future[None]] = {}  # each request's newest call not yet handed on (scheduler's thread)
        self._last: Future[None] | None = None  # the newest call: calls run one after another, in step order
        self._resume_at = 0.0  # no call starts before this (perf_counter), while a share below 1 holds

    def step(self, due: list[Sample], alone: bool) -> None:
        """After a step: start the call of its ``due`` previews (``SlotTable.due``), or drop them (module docs).
        ``alone``: no generation is in flight but the previewed one."""
        for request in [r for r, call in self._pending.items() if call.done()]:  # handed on: forget them (cancelled ones too)
            del self._pending[request]
        due = sorted((s for s in due if s.request.on_preview and not s.request.future.done()), key=lambda s: (s.request.order, s.index))
        if not due:
            return
        share = self.shares.alone if alone else self.shares.busy
        if share < 1 and (time.perf_counter() < self._resume_at or (self._last is not None and not self._last.done())):
            self._observe(0, len(due), 0.0)
            return
        latents, mask = slot_rows([s.state for s in due], "x0_hat")  # copied here: the next step moves on
        rows = [(s.request, s.index, s.state.step) for s in due]
        self._last = call = self._worker.submit(self._call, rows, latents, mask, share, ready_event(latents))
        for request, *_ in rows:
            self._pending[request] = call

    def pending(self, request: Generation) -> Future[None] | None:
        """On the scheduler's thread: the call holding ``request``'s newest previews, None when none is pending."""
        return self._pending.pop(request, None)

    def after_previews(self, call: Future[None] | None, answer: Callable[[], None]) -> None:
        """Run ``answer`` once ``call``'s previews are handed on (``pending``): at once, or on the previews'
        thread right after them. Any thread may call it."""
        if call is None or call.done():
            answer()
        else:
            self._worker.submit(answer)

    def wait(self) -> None:
        """Until every call started so far is over and its previews handed on."""
        if self._last is not None:
            self._last.result()

    def close(self) -> None:
        """Finish the calls and answers queued, then stop the thread."""
        self._worker.shutdown(wait=True)

    def _call(self, rows: list[_Due], latents: Tensor, mask: Tensor, share: float, ready: Any) -> None:
        """One decoder call, on the previews' thread; each request gets its own previews, in sample order."""
        started = time.perf_counter()
        try:
            if ready is not None:
                ready.synchronize()
            decoded = self.pipeline.decode(latents, mask)
        except Exception:  # a preview is a nicety: never let it end a request or the scheduler
            log.exception("decoding previews failed; they are skipped")
            self._observe(0, len(rows), 0.0)
            return
        seconds = time.perf_counter() - started
        if share < 1:
            self._resume_at = time.perf_counter() + seconds * (1 - share) / share
        by_request: dict[Generation, list[Preview]] = {}
        for row, (request, index, step) in enumerate(rows):
            ids = decoded.token_ids[row, : decoded.lengths[row]].tolist()
            by_request.setdefault(request, []).append(Preview(index, step, ids, decoded.texts[row]))
        dropped = 0
        for request, previews in by_request.items():
            if request.future.done():
                dropped += len(previews)
                continue
            try:
                request.on_preview(previews)  # type: ignore[misc]
            except Exception as error:  # a broken hook ends its own request, with its error, never the batch
                log.exception("preview hook failed; its request ends with the error")
                resolve_future(request.future, error=error)
        self._observe(len(rows) - dropped, dropped, seconds)

    def _observe(self, decoded: int, dropped: int, seconds: float) -> None:
        if self.observer is not None:
            self.observer(decoded, dropped, seconds)


class Delivery:
    def __init__(self, engine: SamplingEngine, pipeline: LDLMPipeline, previews: PreviewDecodes | None = None) -> None:
        self.engine = engine
        self.pipeline = pipeline  # its decode (through the decoder's batcher in the server)
        self.preview_decodes = previews or PreviewDecodes(pipeline)
        self._answers = ThreadPoolExecutor(1, thread_name_prefix="ldlm-answers")  # finished requests, in step order

    def previews(self, samples: list[Sample], alone: bool = True) -> None:
        """The step's due previews (``PreviewDecodes.step``); hooks run on the previews' thread, so they must only hand them on."""
        self.preview_decodes.step(samples, alone)

    def finish(self, finished: list[Sample]) -> None:
        """Record finished samples' latents; the requests they complete are decoded and answered on the
        answers' thread, after their previews: the argmax ones in one decoder call, each request that samples
        its tokens (its own temperature, nucleus and seed) on its own."""
        complete: list[Generation] = []
        for sample in finished:
            request = sample.request
            request.latents[sample.index] = self.engine.latent(sample.state)
            request.remaining -= 1
            if request.remaining == 0 and not request.future.done():
                complete.append(request)
        if complete:
            calls = {request: self.preview_decodes.pending(request) for request in complete}
            self._answers.submit(self._answer, calls, ready_event(complete[0].latents[0]))  # type: ignore[arg-type]

    def close(self) -> None:
        """Answer what finished (its previews first), then stop both threads."""
        self._answers.shutdown(wait=True)
        self.preview_decodes.close()

    def _answer(self, calls: dict[Generation, Future[None] | None], ready: Any) -> None:
        """On the answers' thread: decode the complete requests' latents and answer each after its previews; a
        failed decode answers its own requests with the error."""
        if ready is not None:
            ready.synchronize()
        complete = list(calls)
        argmax = [r for r in complete if r.decoding is None or not r.decoding.needs_logits]
        for request in complete:
            if request.decoding is not None and request.decoding.needs_logits:
                self._decode_sampled(request, calls[request])
        if not argmax:
            return
        began = time.perf_counter()
        try:
            decoded = decode_ragged(self.pipeline, [z for r in argmax for z in r.latents])  # type: ignore[misc]
        except Exception as error:
            for request in argmax:
                resolve_future(request.future, error=error)
            return
        mark_decoded(argmax, began)
        start = 0
        for request in argmax:
            n, length = request.plan.n, request.plan.length
            rows = slice(start, start + n)
            result = TextResult(decoded.token_ids[rows, :length], decoded.texts[rows], decoded.lengths[rows], plan=request.plan)
            self.preview_decodes.after_previews(calls[request], functools.partial(resolve_future, request.future, result))
            start += n

    def _decode_sampled(self, request: Generation, previews: Future[None] | None) -> None:
        """One request whose tokens are drawn from the logits; its error (e.g. no logits output) is its own."""
        began = time.perf_counter()
        try:
            result = self.pipeline.decode(torch.stack(request.latents), sampling=request.decoding)  # type: ignore[arg-type]
        except Exception as error:
            resolve_future(request.future, error=error)
            return
        mark_decoded([request], began)
        result.plan = request.plan
        self.preview_decodes.after_previews(previews, functools.partial(resolve_future, request.future, result))


def mark_decoded(requests: list[Generation], began: float) -> None:
    """The traced ones among ``requests``, decoded in one call that began at ``began``, mark it (tracing.py)."""
    ended = time.perf_counter()
    for request in requests:
        if request.trace is not None:
            request.trace.decoding, request.trace.decoded = began, ended


def ready_event(tensor: Tensor) -> Any:
    """On CUDA, an event after the work queued so far on this thread's stream (what made ``tensor``): the
    thread that decodes it waits on it, the scheduler's thread never does. None elsewhere."""
    if tensor.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def slot_rows(states: list[SampleState], name: str) -> tuple[Tensor, Tensor]:
    """Copies of ``states``' rows of one state tensor (``x0_hat``) from their persistent batches, one gather per
    table, cut to the longest sample and right-padded across tables, and the mask of each sample's length."""
    parts: list[Tensor] = []
    order: list[SampleState] = []
    for table in {id(s.table): s.table for s in states}.values():
        own = [s for s in states if s.table is table]
        parts.append(table.rows(name, own))  # type: ignore[union-attr]
        order += own
    longest = max(s.length for s in states)
    rows = torch.cat([F.pad(p[:, :longest], (0, 0, 0, max(0, longest - p.shape[1]))) for p in parts])
    if order != states:  # back to the callers' order
        rows = rows.index_select(0, to_device(torch.tensor([order.index(s) for s in states]), rows.device))
    mask = torch.arange(longest)[None] < torch.tensor([s.length for s in states])[:, None]
    return rows, mask


def ragged_batch(latents: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Latents of different lengths, each (L_i, D) -> one batch right-padded to the longest and its mask."""
    longest = max(z.shape[0] for z in latents)
    mask = torch.zeros(len(latents), longest, dtype=torch.bool)
    for i, z in enumerate(latents):
        mask[i, : z.shape[0]] = True
    return torch.stack([F.pad(z, (0, 0, 0, longest - z.shape[0])) for z in latents]), mask


def decode_ragged(pipeline: LDLMPipeline, latents: list[Tensor]) -> TextResult:
    """Latents of different lengths, each (L_i, D), in one decoder call: right-padded to the longest,
    the padding masked; each row's ``lengths`` entry is its own L_i."""
    return pipeline.decode(*ragged_batch(latents))
