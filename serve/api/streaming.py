"""Server-Sent Events for generation: denoising previews, then the result.

A ``GenerationStream`` submits one request to the scheduler with a preview hook. The hook runs on
the scheduler's worker thread and only hands each sample's x0_hat to the ``PreviewDecoder`` (the
newest per sample replaces an older one not yet decoded, so nothing backs up). That one thread
decodes every pending preview of every stream in one decoder call, then rests so that previews
take at most ``budget`` of the wall time: generation keeps its pace whatever the number of
streams, and under load a preview is skipped (the next one is newer) rather than slowing anyone.

When the client goes away the response's generator is cancelled; its ``finally`` cancels the
request's future, and the scheduler drops the request's samples at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from torch import Tensor

from ldlm.pipeline import LDLMPipeline, TextResult
from ldlm.serve.runtime.scheduler import GenerateRequest, GenerationScheduler, decode_ragged

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One Server-Sent Event: ``event: name`` (optional), one ``data:`` line, a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return (f"event: {event}\n" if event else "").encode() + f"data: {payload}\n\n".encode()


class PreviewDecoder:
    """One thread that decodes the pending previews of all streams, in one call, within a time budget."""

    def __init__(self, pipeline: LDLMPipeline, budget: float = 0.05) -> None:
        if not 0 < budget <= 1:
            raise ValueError(f"budget={budget} is out of range; allowed: (0, 1]")
        self.pipeline, self.budget = pipeline, budget
        self._pending: dict[tuple[GenerationStream, int], tuple[int, Tensor]] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="ldlm-previews", daemon=True)
        self._thread.start()

    def offer(self, stream: GenerationStream, index: int, step: int, x0_hat: Tensor) -> None:
        with self._cond:
            self._pending[(stream, index)] = (step, x0_hat)
            self._cond.notify()

    def forget(self, stream: GenerationStream) -> None:
        with self._cond:
            for key in [k for k in self._pending if k[0] is stream]:
                del self._pending[key]

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(10)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                batch, self._pending = self._pending, {}
            started = time.perf_counter()
            try:
                texts = decode_ragged(self.pipeline, [x0 for _, x0 in batch.values()]).texts
            except Exception:  # a preview is a nicety: never let it end a stream or this thread
                continue
            by_stream: dict[GenerationStream, list[dict[str, Any]]] = {}
            for ((stream, index), (step, _)), text in zip(batch.items(), texts):
                by_stream.setdefault(stream, []).append({"index": index, "step": step, "text": text})
            for stream, previews in by_stream.items():
                with contextlib.suppress(RuntimeError):  # its event loop is gone (shutdown): nobody to tell
                    stream.deliver(sorted(previews, key=lambda p: p["index"]))
            busy = time.perf_counter() - started
            with self._cond:  # rest: decoding takes at most `budget` of the time
                self._cond.wait_for(lambda: self._stopping, timeout=busy * (1 - self.budget) / self.budget)

class GenerationStream:
    """One request in the scheduler, as an async iterator of previews and then its result."""

    def __init__(self, scheduler: GenerationScheduler, previews: PreviewDecoder | None, spec: GenerateRequest,
                 preview_every: int = 0, prefix: Tensor | None = None, *, loop: asyncio.AbstractEventLoop) -> None:
        """Submits at once. ``loop`` is the event loop that reads the events: construct this off that
        loop (submitting draws every sample's prior noise, work that scales with n x length)."""
        self.loop = loop
        self.previews = previews
        self.spec = spec
        self._decoded: list[dict[str, Any]] = []
        self._wake = asyncio.Event()
        hook = self._hook if preview_every > 0 and previews is not None else None
        self.future = scheduler.submit(spec, prefix, hook, preview_every)

    def _hook(self, index: int, step: int, x0_hat: Tensor) -> None:  # on the scheduler's thread: hand over only
        self.previews.offer(self, index, step, x0_hat)  # type: ignore[union-attr]

    def deliver(self, previews: list[dict[str, Any]]) -> None:  # on the preview thread
        self.loop.call_soon_threadsafe(self._put, previews)

    def _put(self, previews: list[dict[str, Any]]) -> None:
        self._decoded += previews
        self._wake.set()

    async def events(self, timeout_s: float) -> AsyncIterator[tuple[str, Any]]:
        """("preview", [{index, step, text}, ...]) any number of times, then ("result", TextResult).
        Raises TimeoutError after ``timeout_s``; always cancels the request when left early."""
        result = asyncio.wrap_future(self.future)
        deadline = self.loop.time() + timeout_s
        try:
            while True:
                woken = asyncio.ensure_future(self._wake.wait())
                done, _ = await asyncio.wait({result, woken}, timeout=max(0.0, deadline - self.loop.time()),
                                             return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                if not done:
                    raise TimeoutError(f"request timed out after {timeout_s:g} s")
                if result.done():
                    final: TextResult = result.result()
                    yield "result", final
                    return
                decoded, self._decoded = self._decoded, []
                self._wake.clear()
                if decoded:
                    yield "preview", decoded
        finally:
            self.future.cancel()  # a gone client or a timeout frees the slots at the scheduler's next step
            result.cancel()
            if self.previews is not None:
                self.previews.forget(self)


async def generate_sse(stream: GenerationStream, timeout_s: float) -> AsyncIterator[bytes]:
    """/v1/generate with ``stream: true``: ``event: preview`` every k steps, then ``event: result``
    (the same JSON as the plain answer), or ``event: error`` with the one error shape."""
    try:
        async for kind, payload in stream.events(timeout_s):
            if kind == "preview":
                yield sse({"steps": stream.spec.steps, "samples": payload}, "preview")
            else:
                yield sse({"texts": payload.texts, "token_ids": payload.ids()}, "result")
    except (TimeoutError, ValueError, RuntimeError) as error:  # the status line is sent: report in-band
        yield sse({"error": str(error)}, "error")
