"""Server-Sent Events for generation: denoising previews, then the result.

A ``GenerationStream`` submits one request to the scheduler with a preview hook. The hook runs on
the scheduler's worker thread and only hands each sample's x0_hat to the event loop (the newest
per sample replaces an older one the client has not been sent yet, so a slow client never backs
up the worker). The previews are decoded here, on the thread pool through the decoder's batcher,
never on the scheduler's thread, so one request's previews do not stall the others' steps.

When the client goes away the response's generator is cancelled; its ``finally`` cancels the
request's future, and the scheduler drops the request's samples at its next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from torch import Tensor

from ldlm.pipeline import LDLMPipeline, TextResult
from ldlm.serve.scheduler import GenerateRequest, GenerationScheduler

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One Server-Sent Event: ``event: name`` (optional), one ``data:`` line, a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return (f"event: {event}\n" if event else "").encode() + f"data: {payload}\n\n".encode()


class GenerationStream:
    """One request in the scheduler, as an async iterator of previews and then its result."""

    def __init__(self, scheduler: GenerationScheduler, decoder: LDLMPipeline, spec: GenerateRequest,
                 preview_every: int = 0, prefix: Tensor | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.decoder = decoder
        self.spec = spec
        self._latest: dict[int, tuple[int, Tensor]] = {}
        self._wake = asyncio.Event()
        hook = self._hook if preview_every > 0 else None
        self.future = scheduler.submit(spec, prefix, hook, preview_every)
        self.submitted = time.perf_counter()

    def _hook(self, index: int, step: int, x0_hat: Tensor) -> None:  # on the scheduler's thread: hand over only
        self.loop.call_soon_threadsafe(self._put, index, step, x0_hat)

    def _put(self, index: int, step: int, x0_hat: Tensor) -> None:
        self._latest[index] = (step, x0_hat)
        self._wake.set()

    def _decode_previews(self, latest: dict[int, tuple[int, Tensor]]) -> list[dict[str, Any]]:
        indices = sorted(latest)
        decoded = self.decoder.decode(torch.stack([latest[i][1] for i in indices]))
        return [{"index": i, "step": latest[i][0], "text": text} for i, text in zip(indices, decoded.texts)]

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
                latest, self._latest = self._latest, {}
                self._wake.clear()
                if latest:
                    yield "preview", await self.loop.run_in_executor(None, self._decode_previews, latest)
        finally:
            self.future.cancel()  # a gone client or a timeout frees the slots at the scheduler's next step
            result.cancel()


async def generate_sse(stream: GenerationStream, timeout_s: float) -> AsyncIterator[bytes]:
    """/v1/generate with ``stream: true``: ``event: preview`` every k steps, then ``event: result``
    (the same JSON as the plain answer), or ``event: error`` with the one error shape."""
    try:
        async for kind, payload in stream.events(timeout_s):
            if kind == "preview":
                yield sse({"steps": stream.spec.steps, "samples": payload}, "preview")
            else:
                yield sse({"texts": payload.texts, "token_ids": payload.token_ids.tolist()}, "result")
    except (TimeoutError, ValueError, RuntimeError) as error:  # the status line is sent: report in-band
        yield sse({"error": str(error)}, "error")
