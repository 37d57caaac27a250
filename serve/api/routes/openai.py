"""OpenAI-compatible routes, so the official ``openai`` client works unchanged.

  GET  /v1/models         the one served model
  POST /v1/completions    model, prompt, max_tokens, n, seed, stream, stream_options, stop, echo, user
                          (+ LDLM's steps, sampler, t_min as extra body fields:
                          ``client.completions.create(..., extra_body={"steps": 20})``)

A diffusion model writes all positions at once. An empty prompt samples unconditionally; a
non-empty prompt conditions by prefix inpainting: its P tokens are encoded, and at every step
their positions are reset to those latents forward-noised to the step's time
(``LDLMPipeline.inpaint_prefix``). The completion is the text decoded after the prompt, at most
``max_tokens`` tokens, cut at the first end-of-text token (``finish_reason: "stop"``; else
``"length"``); ``stop`` ends it before the first of up to 4 texts (``"stop"``), and ``echo`` puts
the prompt before it. ``temperature`` (0, the default: the token decoder's argmax), ``top_p`` and
``logprobs`` act where the model has a distribution over tokens, at the token decoder: each token
is drawn from softmax(logits / temperature) within the nucleus, seeded by ``seed``, and ``logprobs``
gives each completion token's log-probability and its top alternatives in OpenAI's legacy shape
(ldlm/sampling/tokens.py); with ``echo``, the prompt's tokens come first, each with the decoder's
log-probability of it at its position (every position has one here, the first included, where
OpenAI's left-to-right models give null). OpenAI parameters that mean nothing to a diffusion sampler (best_of, the
penalties, logit_bias, suffix) are accepted only at the value that asks for nothing, else refused
(400) naming the parameter; unknown fields are refused too. How
well a completion follows its prompt depends on the trained model: a random-init checkpoint gives
gibberish. With ``stream: true`` every choice comes as one OpenAI
chunk once its text is final (diffusion has no left-to-right deltas), then ``data: [DONE]``.
Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``.
"""

# No `from __future__ import annotations`: the body model carries this server's limits, so it is built
# per app, and FastAPI reads a handler's parameter types from its live annotations.

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

import torch
from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import TextResult
from ldlm.sampling import GenerateRequest
from ldlm.sampling.tokens import TokenLogprobs, TokenSampling
from ldlm.serve.api.errors import REQUEST_ERRORS, HTTPError, error_status, openai_error
from ldlm.serve.api.offload import Deadline, json_response, run_blocking, run_submit, wait
from ldlm.serve.api.openai_schemas import MODEL_ID, check_supported, completion_body, token_sampling
from ldlm.serve.api.service import LDLMService
from ldlm.serve.api.streaming import SSE_HEADERS, sse

# One prompt's token ids, its scheduler request, and how its tokens are chosen (None: argmax).
Prepared = list[tuple[list[int], GenerateRequest, TokenSampling | None]]


def create_router(service: LDLMService) -> APIRouter:
    config = service.config
    CompletionBody = completion_body(service.body_limits())
    completer = Completions(service)
    router = APIRouter()
    created = int(time.time())

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The served model, as OpenAI lists models."""
        return {
            "object": "list",
            "data": [{"id": MODEL_ID, "object": "model", "created": created, "owned_by": "ldlm", "max_model_len": config.max_seq_len}],
        }

    @router.post("/v1/completions", summary="OpenAI-compatible completions")
    async def completions(body: CompletionBody) -> Response:  # type: ignore[valid-type]
        """OpenAI completions by a diffusion model; see the module docs for how prompts condition."""
        return await completer.answer(body)

    return router


def prompt_text(body: Any, i: int) -> str:
    return body.prompt if isinstance(body.prompt, str) else body.prompt[i]


class Completions:
    """The work behind POST /v1/completions: prompts -> scheduler requests -> OpenAI choices, whole or streamed."""

    def __init__(self, service: LDLMService) -> None:
        self.service = service
        self.settings, self.config, self.pipeline = service.settings, service.config, service.pipeline

    def prepare(self, body: Any) -> Prepared:
        """Per prompt: its token ids and the scheduler request (off the loop: tokenizing is work)."""
        settings, config = self.settings, self.config
        if body.model != MODEL_ID:
            raise HTTPError(404, f"model {body.model!r} does not exist; available: {MODEL_ID}", param="model")
        check_supported(body)
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        if not 1 <= len(prompts) <= settings.max_texts:
            raise HTTPError(400, f"prompt has {len(prompts)} items; allowed: 1..{settings.max_texts}")
        if len(prompts) * body.n > settings.max_n:
            raise HTTPError(
                400, f"{len(prompts)} prompts x n={body.n} is {len(prompts) * body.n} choices; allowed: up to {settings.max_n} per request"
            )
        ids = [[] if p == "" else self.pipeline.tokenizer.encode([p])[0] for p in prompts]
        seed = body.seed if body.seed is not None else int.from_bytes(uuid.uuid4().bytes[:7], "big")
        has_logits = getattr(self.pipeline.graphs, "has_logits", True)
        prepared = []
        for i, row in enumerate(ids):
            if len(row) + body.max_tokens > config.max_seq_len:
                name = "prompt" if isinstance(body.prompt, str) else f"prompt[{i}]"
                raise HTTPError(
                    400,
                    f"{name} has {len(row)} tokens and max_tokens is {body.max_tokens}: {len(row) + body.max_tokens} "
                    f"tokens in all; allowed: up to {config.max_seq_len} (the model's max_seq_len)",
                )
            seed_i = (seed + i) % 2**63
            spec = body.to_request(len(row), seed_i)
            prepared.append((row, spec, token_sampling(body, spec.seed, has_logits, row)))
        return prepared

    def prefix_latents(self, rows: list[list[int]]) -> list[torch.Tensor | None]:
        return [None if not row else self.pipeline.encode([row]).latents[0].cpu() for row in rows]

    def choices(self, row: list[int], result: TextResult, first_index: int, body: Any, prompt: str) -> tuple[list[dict[str, Any]], int]:
        """The text after the prompt, cut at end-of-text and before the first stop text (``stop``),
        preceded by the prompt with ``echo``; and the completion tokens counted."""
        out, used = [], 0
        eos = self.config.eos_token_id
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        for j, ids in enumerate(result.token_ids[:, len(row) :].tolist()):
            stop = eos in ids
            ids = ids[: ids.index(eos)] if stop else ids
            text = self.pipeline.tokenizer.decode(ids)
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if cut >= 0:  # the tokens counted are those of the text returned (which may be blank)
                text, stop = text[:cut], True
            used += self.pipeline.tokenizer.count_tokens(text) if cut >= 0 else len(ids)
            logprobs = None
            if body.logprobs is not None and result.logprobs is not None:
                start = len(prompt) if body.echo else 0
                logprobs = choice_logprobs(self.pipeline.tokenizer, ids, result.logprobs, (j, len(row)), start, cut if cut >= 0 else None)
                if body.echo:  # the prompt's tokens first, each with the decoder's log-probability at its position
                    echoed = choice_logprobs(self.pipeline.tokenizer, row, result.logprobs, (j, 0), 0, None)
                    logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
            out.append(
                {
                    "text": prompt + text if body.echo else text,
                    "index": first_index + j,
                    "logprobs": logprobs,
                    "finish_reason": "stop" if stop else "length",
                }
            )
        return out, used

    def submit(self, prepared: Prepared, prefixes: list[torch.Tensor | None], deadline: Deadline) -> list[Future[TextResult]]:
        """Queue every prompt's request, all or none (off the loop: each draws its samples' prior noise).
        When one fails (a full queue: 503 by GuardMiddleware), those already queued are cancelled,
        or they would run for nobody."""
        futures: list[Future[TextResult]] = []
        try:
            for (_, spec, decoding), prefix in zip(prepared, prefixes):
                futures.append(self.service.submit_generation(spec, prefix, deadline_s=deadline.left(), decoding=decoding))
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return futures

    async def start(self, body: Any, deadline: Deadline) -> tuple[Prepared, list[Future[TextResult]]]:
        try:
            prepared = await run_blocking(self.prepare, body, timeout_s=deadline.left())
            prefixes = await run_blocking(self.prefix_latents, [row for row, _, _ in prepared], timeout_s=deadline.left())
        except ValueError as error:  # the tokenizer's and pipeline's messages name the bad value
            raise HTTPError(400, str(error)) from None
        futures = await run_submit(
            self.submit, prepared, prefixes, deadline, cancel=lambda queued: [f.cancel() for f in queued], timeout_s=deadline.left()
        )
        return prepared, futures

    async def answer(self, body: Any) -> Response:
        """The whole completion as one JSON answer, or (``stream: true``) as OpenAI chunks."""
        deadline = Deadline(self.settings.request_timeout_s if body.timeout_s is None else body.timeout_s)
        prepared, futures = await self.start(body, deadline)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": MODEL_ID}
        prompt_tokens = sum(len(row) for row, _, _ in prepared) * body.n
        if body.stream:
            return StreamingResponse(
                self.stream_chunks(head, prepared, futures, prompt_tokens, body, deadline),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        try:
            results = await wait(asyncio.gather(*(asyncio.wrap_future(f) for f in futures)), deadline.left(), deadline.limit_s)
        finally:
            for future in futures:
                future.cancel()  # no-op when finished; frees the slots when the client left or time ran out
        every, used = [], 0
        for i, ((row, _, _), result) in enumerate(zip(prepared, results)):
            got, n_used = self.choices(row, result, i * body.n, body, prompt_text(body, i))
            every += got
            used += n_used
        plan = {"ldlm_plan": results[0].plan.summary()} if results and results[0].plan is not None else {}
        return await json_response(self.service, {**head, "choices": every, "usage": usage(prompt_tokens, used), **plan})

    async def stream_chunks(
        self, head: dict[str, Any], prepared: Prepared, futures: list[Future[TextResult]], prompt_tokens: int, body: Any, deadline: Deadline
    ) -> AsyncIterator[bytes]:
        used = 0
        pending = {asyncio.ensure_future(wait(asyncio.wrap_future(f), deadline.left(), deadline.limit_s)): i for i, f in enumerate(futures)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    result = task.result()
                    got, n_used = self.choices(prepared[i][0], result, i * body.n, body, prompt_text(body, i))
                    used += n_used
                    plan = {} if result.plan is None else {"ldlm_plan": result.plan.summary()}
                    yield sse({**head, "choices": got, **plan})
            if body.stream_options is not None and body.stream_options.include_usage:
                yield sse({**head, "choices": [], "usage": usage(prompt_tokens, used)})
        except REQUEST_ERRORS as error:  # the status line is sent: report in-band, in OpenAI's shape
            status, message, _ = error_status(error)
            yield sse(openai_error(status, message))
        finally:
            for future in futures:
                future.cancel()
            for task in pending:
                task.cancel()
        yield sse("[DONE]")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def choice_logprobs(
    tokenizer: TextTokenizer, ids: list[int], logprobs: TokenLogprobs, at: tuple[int, int], start: int, cut: int | None
) -> dict[str, Any]:
    """OpenAI's legacy ``logprobs`` of one choice: per completion token its text, its log-probability, the
    top alternatives (with the chosen token, as OpenAI gives it) and where it starts in the choice's text.
    ``at``: (row, first completion position) in ``logprobs``; ``start``: the echoed prompt's length;
    ``cut``: where a stop text cut the completion (tokens starting at or after it are not returned)."""
    row, first = at
    tokens, chosen, top, offsets = [], [], [], []
    offset = 0
    for t, token in enumerate(ids):
        if cut is not None and offset >= cut:
            break
        text = token_text(tokenizer, token)
        alternatives = {
            token_text(tokenizer, int(i)): float(v) for i, v in zip(logprobs.top_ids[row, first + t], logprobs.top[row, first + t])
        }
        chosen.append(float(logprobs.chosen[row, first + t]))
        alternatives.setdefault(text, chosen[-1])
        tokens.append(text)
        top.append(alternatives)
        offsets.append(start + offset)
        offset += len(tokenizer.decode([token]))  # the mask token is named but adds no text
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": top, "text_offset": offsets}


def token_text(tokenizer: TextTokenizer, token: int) -> str:
    """A token as ``logprobs`` names it: its text; end-of-text and the mask token (which decode to "") by name."""
    if token == tokenizer.eos_token_id:
        return "<|endoftext|>"
    return tokenizer.decode([token]) if token < tokenizer.vocab_size else "<|mask|>"
