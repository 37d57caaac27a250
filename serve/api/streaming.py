"""Server-Sent Events for generation: denoising previews, then the result.

A ``GenerationStream`` submits one request to the scheduler with a preview hook. The scheduler decodes
the previews of every stream in one decoder call per step and hands each stream its own, in step order
and before its result (serve/runtime/delivery.py says exactly when a preview is dropped: its request is
answered, its call failed, or previews have had their share of the time, which by default limits them
only beside other work). The hook runs on the scheduler's preview thread and only hands them to the
stream's event loop, which sends one event per step.

When the client goes away the response's generator is cancelled; its ``finally`` cancels the request's
future, and the scheduler drops its samples at its next step, and its previews with them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any

from torch import Tensor

from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import TextResult, keep_prompt
from ldlm.sampling import GenerateRequest
from ldlm.serve.api.errors import REQUEST_ERRORS, error_status
from ldlm.serve.api.offload import Deadline, run_blocking, run_submit, wait
from ldlm.serve.api.prompted import prompt_prefix, with_prompt
from ldlm.serve.api.service import LDLMService
from ldlm.serve.runtime.generation import Preview
from ldlm.serve.runtime.tracing import CURRENT, RequestTrace

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One Server-Sent Event: ``event: name`` (optional), one ``data:`` line, a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return (f"event: {event}\n" if event else "").encode() + f"data: {payload}\n\n".encode()


class GenerationStream:
    """One request in the scheduler, as an async iterator of previews and then its result."""

    def __init__(
        self,
        submit: Callable[..., Future[TextResult]],
        tokenizer: TextTokenizer,
        spec: GenerateRequest,
        preview_every: int = 0,
        prefix: Tensor | None = None,
        *,
        loop: asyncio.AbstractEventLoop,
        prompt_ids: Sequence[int] = (),
        steps: int | None = None,
        trace: RequestTrace | None = None,
        first_preview: Callable[[float], None] | None = None,
        started: float = 0.0,
    ) -> None:
        """Submits at once, with ``submit`` (``GenerationScheduler.submit``'s signature). ``loop`` is the
        event loop that reads the events: construct this off that loop (submitting draws every sample's
        prior noise, work that scales with n x length). ``prompt_ids``: the prompt's tokens, whose latents
        ``prefix`` holds; previews start with them as given (serve/api/prompted.py), in ``tokenizer``'s text.
        ``steps``: the request's resolved step count, which its previews name (None: the spec's own). ``trace``: the
        traced request it is (its previews become events of its span); ``first_preview``: told the seconds from ``started``
        (``time.perf_counter``) to its first preview sent."""
        self.loop = loop
        self.trace, self.first_preview, self.started = trace, first_preview, started
        self.tokenizer = tokenizer
        self.spec = spec
        self.steps = spec.steps if steps is None else steps
        self.prompt_ids = list(prompt_ids)
        self._decoded: list[dict[str, Any]] = []
        self._wake = asyncio.Event()
        self.future = submit(spec, prefix, self._hook if preview_every > 0 else None, preview_every)

    def _hook(self, previews: list[Preview]) -> None:  # on the scheduler's preview thread: hand over only
        shown = [
            {
                "index": p.index,
                "step": p.step,
                "text": with_prompt(p.token_ids, self.prompt_ids, self.tokenizer) if self.prompt_ids else p.text,
            }
            for p in previews
        ]
        self.loop.call_soon_threadsafe(self._put, shown)

    def _put(self, previews: list[dict[str, Any]]) -> None:
        self._decoded += previews
        self._wake.set()

    def _sent(self, step: int) -> None:
        """A preview of ``step`` goes out: the first one is timed, and a traced request's span gets an event of each."""
        if self.first_preview is not None:
            self.first_preview(time.perf_counter() - self.started)
            self.first_preview = None
        if self.trace is not None:
            self.trace.preview(step)

    async def events(self, timeout_s: float) -> AsyncIterator[tuple[str, Any]]:
        """("preview", [{index, step, text}, ...] of one step) any number of times, then ("result", TextResult).
        Raises TimeoutError after ``timeout_s``; always cancels the request when left early."""
        result = asyncio.wrap_future(self.future)
        deadline = self.loop.time() + timeout_s
        try:
            while True:
                self._wake.clear()
                # the scheduler hands over a request's previews before its result, and the loop runs them in
                # that order: every preview delivered before the result is sent before it
                while self._decoded:
                    decoded, self._decoded = self._decoded, []
                    for step in sorted({p["step"] for p in decoded}):  # one event per step, in order
                        self._sent(step)
                        yield "preview", [p for p in decoded if p["step"] == step]
                if result.done():
                    final: TextResult = result.result()
                    yield "result", final
                    return
                now = self.loop.time()
                if now >= deadline:
                    raise TimeoutError(f"request timed out after {timeout_s:g} s")
                woken: asyncio.Future[Any] = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait({result, woken}, timeout=deadline - now, return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
        finally:
            self.future.cancel()  # a gone client or a timeout frees the slots at the scheduler's next step
            result.cancel()


def ran(result: TextResult) -> dict[str, Any] | None:
    """The plan that produced ``result`` (sampler, steps, grid, t_min, prior temperature), as answers name it."""
    return None if result.plan is None else result.plan.summary()


async def encoded_prompt(service: LDLMService, prompt: str, length: int, deadline: Deadline) -> tuple[Tensor | None, list[int]]:
    """A prompt's latents to inpaint and its token ids (``prompted.prompt_prefix``); (None, []) for no prompt. The
    encoder runs: off the event loop."""
    if not prompt:
        return None, []
    return await run_blocking(prompt_prefix, service.pipeline, prompt, length, timeout_s=deadline.left())


async def generate_texts(service: LDLMService, spec: GenerateRequest, prompt: str, deadline: Deadline) -> TextResult:
    """One generation's result, as /v1/generate answers it without a stream: the prompt's tokens encoded (the
    encoder runs: off the event loop), the request submitted to the scheduler, which refuses at once what it
    estimates cannot finish in the time left, and awaited (cancelled when left: freed at the next step). The
    texts and token ids start with the prompt verbatim."""
    prefix, ids = await encoded_prompt(service, prompt, spec.length, deadline)
    # draws the prior noise: off the loop, where the request's trace (a context variable) is not set: it is passed on
    submit = functools.partial(service.submit_generation, deadline_s=deadline.left(), trace=CURRENT.get())
    future = await run_submit(submit, spec, prefix, cancel=Future.cancel, timeout_s=deadline.left())
    result = await wait(future, deadline.left(), deadline.limit_s)
    return keep_prompt(result, ids, service.pipeline.tokenizer) if ids else result


async def start_stream(
    service: LDLMService, spec: GenerateRequest, prompt: str, every: int, deadline: Deadline, route: str
) -> tuple[GenerationStream, list[int], int]:
    """A generation started as a stream of a preview every ``every`` steps (0: none) then its result, as /v1/generate
    with ``stream: true`` and gRPC's ldlm_generate stream start it: the prompt's tokens encoded (the encoder runs:
    off the event loop), its steps planned (bad input is refused here, before the stream), and the request
    submitted (which draws every sample's prior noise: off the event loop too; the scheduler refuses at once what
    it estimates cannot finish in the time left). The stream, the prompt's token ids and the steps it runs. Its time to
    the first preview counts under ``route`` in /metrics."""
    started, trace = time.perf_counter(), CURRENT.get()
    prefix, ids = await encoded_prompt(service, prompt, spec.length, deadline)
    steps = service.scheduler.plan(spec).steps
    submit = functools.partial(service.submit_generation, deadline_s=deadline.left(), trace=trace)
    loop, tokenizer = asyncio.get_running_loop(), service.pipeline.tokenizer
    timed = service.metrics.first_preview_seconds.labels(route).observe
    start = functools.partial(
        GenerationStream, submit, tokenizer, spec, every, prefix, loop=loop, prompt_ids=ids, steps=steps,
        trace=trace, first_preview=timed, started=started,
    )  # fmt: skip
    stream = await run_submit(start, cancel=lambda s: s.future.cancel(), timeout_s=deadline.left())
    return stream, ids, steps


async def generate_sse(stream: GenerationStream, timeout_s: float, tokenizer: TextTokenizer | None = None) -> AsyncIterator[bytes]:
    """/v1/generate with ``stream: true``: ``event: preview`` every k steps, then ``event: result``
    (the same JSON as the plain answer), or ``event: error`` with the one error shape. ``tokenizer``
    puts a prompted stream's prompt back at the start of its result, as given (``stream.prompt_ids``)."""
    try:
        async for kind, payload in stream.events(timeout_s):
            if kind == "preview":
                yield sse({"steps": stream.steps, "samples": payload}, "preview")
            else:
                shown = keep_prompt(payload, stream.prompt_ids, tokenizer) if stream.prompt_ids and tokenizer is not None else payload
                yield sse({"texts": shown.texts, "token_ids": shown.ids(), "plan": ran(shown)}, "result")
    except REQUEST_ERRORS as error:  # the status line is sent: report in-band
        yield sse({"error": error_status(error)[1]}, "error")
