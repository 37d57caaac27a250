"""Server-Sent Events for generation: denoising previews, then the result.

A ``GenerationStream`` submits one request to the scheduler with a preview hook. The hook runs on
the scheduler's worker thread and only hands each sample's x0_hat to the ``PreviewDecoder``; that
one thread decodes a preview of every sample of every stream in one decoder call. Decoding previews
takes at most a share of the wall time (plus one call): ``budget`` while a generation other than the
stream's own is in flight (its own counts until its result is in; ``PreviewDecoder.others_waiting``),
``lone_budget`` while none is.

- After each call the thread rests busy x (1 - share) / share; a sample's newest x0_hat replaces one
  not yet decoded (skipped, and counted), so nothing backs up. A call takes the newest preview of every
  sample waiting: for T seconds a stream gets about T x share / busy previews (busy: one call's
  seconds), the first call may add one, and its result never waits for previews not yet decoded.
- Alone, at the default third, a stream takes at most 1.5 times its plain run: every preview where a
  decoder call costs little against the steps between previews (base), about a third of the time's
  worth where it costs many (tiny: a 64-token decode takes about forty denoiser calls).
- A share of 1 (``--preview-lone-budget 1``): every preview asked for is decoded and sent, in step
  order, and the stream's result waits for its last previews (1.64 times a plain run on tiny for
  previews every 5 of 21 steps).

When the client goes away the response's generator is cancelled; its ``finally`` cancels the request's
future, the scheduler drops its samples at its next step, and a preview offered meanwhile is not decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from torch import Tensor

from ldlm.limits import BUDGET, PREVIEW_BUDGET, PREVIEW_LONE_BUDGET
from ldlm.pipeline import LDLMPipeline, TextResult
from ldlm.sampling import GenerateRequest
from ldlm.serve.api.errors import REQUEST_ERRORS, error_status
from ldlm.serve.api.prompted import after_prompt, texts_after
from ldlm.serve.runtime.delivery import decode_ragged
from ldlm.tokenizer import TextTokenizer

log = logging.getLogger("ldlm.serve")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One Server-Sent Event: ``event: name`` (optional), one ``data:`` line, a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return (f"event: {event}\n" if event else "").encode() + f"data: {payload}\n\n".encode()


PreviewObserver = Callable[[int, int, float], None]  # (previews decoded, previews skipped, decode seconds)
InFlight = Callable[[], int]  # generations submitted and not yet answered, streams included
PendingPreview = tuple["GenerationStream", int, int, Tensor]  # (stream, sample index, step, x0_hat)


def answered(stream: object) -> bool:
    """Whether ``stream``'s request has its result (or was cancelled). False until ``submit`` has
    returned: the scheduler's thread may run the first steps, and call the hook, before that."""
    future = getattr(stream, "future", None)
    return future is not None and future.done()


def abandoned(stream: object) -> bool:
    """Whether ``stream``'s request was cancelled: its client left or its time ran out (nobody reads it)."""
    future = getattr(stream, "future", None)
    return future is not None and future.cancelled()


class PreviewDecoder:
    """One thread that decodes a pending preview of every sample of all streams, in one call, within its share of
    the wall time (module docs). ``in_flight``: the number of generations submitted and not yet answered;
    without it every stream counts as beside others."""

    def __init__(
        self,
        pipeline: LDLMPipeline,
        budget: float = PREVIEW_BUDGET,
        in_flight: InFlight | None = None,
        observer: PreviewObserver | None = None,
        lone_budget: float = PREVIEW_LONE_BUDGET,
    ) -> None:
        for name, value in (("budget", budget), ("lone_budget", lone_budget)):
            BUDGET.check(name, value)
        self.pipeline, self.budget, self.lone_budget = pipeline, budget, lone_budget
        self.in_flight = in_flight
        self.observer = observer
        self._pending: dict[tuple[GenerationStream, int], list[tuple[int, Tensor]]] = {}
        self._skipped: dict[GenerationStream, int] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="ldlm-previews", daemon=True)
        self._thread.start()

    def others_waiting(self, stream: GenerationStream) -> bool:
        """Whether a generation other than ``stream``'s own is in flight. Its own counts in ``in_flight``
        until its result is in, and no longer once it is (while it still waits for previews)."""
        if self.in_flight is None:
            return True
        return self.in_flight() > (0 if answered(stream) else 1)

    def share(self, stream: GenerationStream) -> float:
        """The share of wall time ``stream``'s previews may take now; 1: every one is decoded, in order."""
        return self.budget if self.others_waiting(stream) else self.lone_budget

    def offer(self, stream: GenerationStream, index: int, step: int, x0_hat: Tensor) -> None:
        with self._cond:
            queued = self._pending.setdefault((stream, index), [])
            if queued and self.share(stream) < 1:  # within a budget only the newest of a sample is decoded
                self._skipped[stream] = self._skipped.get(stream, 0) + len(queued)
                queued.clear()
            queued.append((step, x0_hat))
            self._cond.notify()

    def forget(self, stream: GenerationStream) -> None:
        """Drop ``stream``'s pending previews; they count as skipped (its result went out without them)."""
        with self._cond:
            dropped = self._skipped.pop(stream, 0)
            for key in [k for k in self._pending if k[0] is stream]:
                dropped += len(self._pending.pop(key))
        if dropped and self.observer is not None:
            self.observer(0, dropped, 0.0)

    def nudge(self) -> None:
        """Other work ended: a rest taken because of it ends now."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(10)

    def _loop(self) -> None:
        while (taken := self._take()) is not None:
            items, skipped = taken
            started = time.perf_counter()
            items = self._decode(items, skipped)
            busy = time.perf_counter() - started
            if self.observer is not None:
                self.observer(len(items), sum(skipped.values()), busy)
            self._rest({stream for stream, *_ in items}, busy)

    def _take(self) -> tuple[list[PendingPreview], dict[GenerationStream, int]] | None:
        """Wait for offers; take one preview of each sample that has one (its oldest at a share of 1, else its
        newest, the older ones skipped) and the skipped counts. None once closing. One per sample: a call
        costs in proportion to its rows, so a backlog (previews offered faster than decoded) goes out a
        step at a time, and a cancel, or company, is seen before each call, not after the whole backlog."""
        with self._cond:
            while not self._pending and not self._skipped and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            skipped, self._skipped = self._skipped, {}
            items: list[PendingPreview] = []
            for (stream, index), queued in list(self._pending.items()):
                if abandoned(stream):  # its request was cancelled (its client left) after it offered: nobody to show it to
                    del self._pending[stream, index]
                    continue
                if len(queued) > 1 and self.share(stream) < 1:  # offered at a share of 1, decoded within a budget
                    skipped[stream] = skipped.get(stream, 0) + len(queued) - 1
                    del queued[:-1]
                step, x0 = queued.pop(0)
                items.append((stream, index, step, x0))
                if not queued:
                    del self._pending[stream, index]
        return items, skipped

    def _rest(self, streams: set[GenerationStream], busy: float) -> None:
        """Rest so that decoding takes at most the smallest share of the streams just served; the rest ends
        early when that share changes (other work ended: ``nudge``)."""
        with self._cond:
            share = min((self.share(s) for s in streams), default=1.0)
            if share < 1:
                self._cond.wait_for(
                    lambda: self._stopping or min((self.share(s) for s in streams), default=1.0) != share,
                    timeout=busy * (1 - share) / share,
                )

    def _decode(self, items: list[PendingPreview], skipped: dict[GenerationStream, int]) -> list[PendingPreview]:
        """Decode ``items`` in one call and hand each stream its previews, in step order, with its skipped
        count; the items decoded (none when the call failed: then they count as skipped)."""
        try:
            kept = [getattr(stream, "kept", 0) for stream, *_ in items]  # a prompted stream's previews: what follows its prompt
            decoded = decode_ragged(self.pipeline, [x0 for *_, x0 in items]) if items else None
            texts = [] if decoded is None else texts_after(decoded, kept, self.pipeline.tokenizer) if any(kept) else decoded.texts
        except Exception:  # a preview is a nicety: never let it end a stream or this thread
            log.exception("decoding previews failed; they are skipped")
            texts = []
            for stream, *_ in items:
                skipped[stream] = skipped.get(stream, 0) + 1
            items = []
        by_stream: dict[GenerationStream, list[dict[str, Any]]] = {stream: [] for stream in skipped}
        for (stream, index, step, _), text in zip(items, texts):
            by_stream.setdefault(stream, []).append({"index": index, "step": step, "text": text})
        for stream, previews in by_stream.items():
            with contextlib.suppress(RuntimeError):  # its event loop is gone (shutdown): nobody to tell
                stream.deliver(sorted(previews, key=lambda p: (p["step"], p["index"])), skipped.get(stream, 0))
        return items


class GenerationStream:
    """One request in the scheduler, as an async iterator of previews and then its result."""

    def __init__(
        self,
        submit: Callable[..., Future[TextResult]],
        previews: PreviewDecoder | None,
        spec: GenerateRequest,
        preview_every: int = 0,
        prefix: Tensor | None = None,
        *,
        loop: asyncio.AbstractEventLoop,
        kept: int = 0,
        steps: int | None = None,
    ) -> None:
        """Submits at once, with ``submit`` (``GenerationScheduler.submit``'s signature). ``loop`` is the
        event loop that reads the events: construct this off that loop (submitting draws every sample's
        prior noise, work that scales with n x length). ``kept``: the prompt's P tokens at the start of
        ``prefix``; previews are of what follows them (serve/api/prompted.py). ``steps``: the request's
        resolved step count, which its previews name (None: the spec's own)."""
        self.loop = loop
        self.previews = previews
        self.spec = spec
        self.steps = spec.steps if steps is None else steps
        self.kept = kept
        self._decoded: list[dict[str, Any]] = []
        self._offered = 0  # previews handed to the decoder (scheduler thread)
        self._settled = 0  # of those, sent or skipped (event loop)
        self._wake = asyncio.Event()
        hook = self._hook if preview_every > 0 and previews is not None else None
        self.future = submit(spec, prefix, hook, preview_every)

    def _hook(self, index: int, step: int, x0_hat: Tensor) -> None:  # on the scheduler's thread: hand over only
        self._offered += 1
        self.previews.offer(self, index, step, x0_hat)  # type: ignore[union-attr]

    def deliver(self, previews: list[dict[str, Any]], skipped: int = 0) -> None:  # on the preview thread
        self.loop.call_soon_threadsafe(self._put, previews, skipped)

    def _put(self, previews: list[dict[str, Any]], skipped: int) -> None:
        self._decoded += previews
        self._settled += len(previews) + skipped
        self._wake.set()

    def _previews_owed(self) -> bool:
        """Previews offered but not yet sent or skipped, at a share of 1 (then every one is worth waiting for)."""
        return self._settled < self._offered and self.previews is not None and self.previews.share(self) >= 1

    async def events(self, timeout_s: float) -> AsyncIterator[tuple[str, Any]]:
        """("preview", [{index, step, text}, ...] of one step) any number of times, then ("result", TextResult).
        Raises TimeoutError after ``timeout_s``; always cancels the request when left early."""
        result = asyncio.wrap_future(self.future)
        deadline = self.loop.time() + timeout_s
        try:
            while True:
                decoded, self._decoded = self._decoded, []
                self._wake.clear()
                for step in sorted({p["step"] for p in decoded}):  # one event per step, in order
                    yield "preview", [p for p in decoded if p["step"] == step]
                now = self.loop.time()
                if result.done() and (result.cancelled() or result.exception() is not None or not self._previews_owed() or now >= deadline):
                    final: TextResult = result.result()
                    yield "result", final
                    return
                if now >= deadline:
                    raise TimeoutError(f"request timed out after {timeout_s:g} s")
                woken: asyncio.Future[Any] = asyncio.ensure_future(self._wake.wait())
                # with the result in, wait only for the previews still owed, re-checking that nobody else waits
                await asyncio.wait(
                    {woken} if result.done() else {result, woken},
                    timeout=min(deadline - now, 0.05) if result.done() else deadline - now,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                woken.cancel()
        finally:
            self.future.cancel()  # a gone client or a timeout frees the slots at the scheduler's next step
            result.cancel()
            if self.previews is not None:
                self.previews.forget(self)


def ran(result: TextResult) -> dict[str, Any] | None:
    """The plan that produced ``result`` (sampler, steps, grid, t_min, prior temperature), as answers name it."""
    return None if result.plan is None else result.plan.summary()


async def generate_sse(stream: GenerationStream, timeout_s: float, tokenizer: TextTokenizer | None = None) -> AsyncIterator[bytes]:
    """/v1/generate with ``stream: true``: ``event: preview`` every k steps, then ``event: result``
    (the same JSON as the plain answer), or ``event: error`` with the one error shape. ``tokenizer``
    cuts a prompted stream's result after its prompt (``stream.kept``)."""
    try:
        async for kind, payload in stream.events(timeout_s):
            if kind == "preview":
                yield sse({"steps": stream.steps, "samples": payload}, "preview")
            else:
                shown = after_prompt(payload, stream.kept, tokenizer) if stream.kept and tokenizer is not None else payload
                yield sse({"texts": shown.texts, "token_ids": shown.ids(), "plan": ran(shown)}, "result")
    except REQUEST_ERRORS as error:  # the status line is sent: report in-band
        yield sse({"error": error_status(error)[1]}, "error")
