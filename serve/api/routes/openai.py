"""OpenAI-compatible routes, so the official ``openai`` client works unchanged, and vLLM's additions to
that API, so what its users call works too.

  GET  /v1/models         the one served model (with ``max_model_len``, as vLLM lists it)
  POST /v1/completions    model, prompt, max_tokens, n, seed, stream, stream_options, stop, echo, user
                          (+ vLLM's ignore_eos, min_tokens, stream_options.continuous_usage_stats;
                          + LDLM's steps, sampler, t_min as extra body fields:
                          ``client.completions.create(..., extra_body={"steps": 20})``)
  GET  /health            200 when ready, 503 otherwise (an empty body, as vLLM's)
  GET  /version           {"version"} (open without the API key, as /health)
  POST /v1/tokenize       {"model"?, "prompt", "add_special_tokens"?, "return_token_strs"?} -> {"count", "max_model_len", "tokens", "token_strs"}
  POST /v1/detokenize     {"model"?, "tokens"} -> {"prompt"}

``prompt`` takes OpenAI's four forms: a text, a list of texts, a list of token ids (one prompt), a list
of token-id lists. Token ids pass through as given (a text is tokenized by GPT-2's BPE, as /v1/tokenize
shows), so a prompt sent as ids and as its text give the same completion. Choices are indexed prompt
by prompt (prompt i's n choices are i*n .. i*n + n-1), and ``usage`` counts as vLLM does: each prompt's
tokens once, whatever ``n``, and the tokens generated (``echo`` adds none).

A diffusion model writes all positions at once. An empty prompt samples unconditionally; a
non-empty prompt conditions by prefix inpainting: its P tokens are encoded, and at every step
their positions are reset to those latents forward-noised to the step's time
(``LDLMPipeline.inpaint_prefix``). The completion is the text decoded after the prompt, at most
``max_tokens`` tokens, cut at the first end-of-text token (``finish_reason: "stop"``; else
``"length"``), unless that token comes before ``min_tokens`` or ``ignore_eos`` is true (vLLM's: every
position was sampled anyway, so they change only where the completion ends); ``stop`` ends it before the first of up to 4 texts (``"stop"``), and ``echo`` puts
the prompt before it (a token-id prompt decoded). ``temperature`` (0, the default: the token decoder's argmax), ``top_p`` and
``logprobs`` act where the model has a distribution over tokens, at the token decoder: each token
is drawn from softmax(logits / temperature) within the nucleus, seeded by ``seed``, and ``logprobs``
gives each completion token's log-probability and its top alternatives in OpenAI's legacy shape
(ldlm/sampling/tokens.py); with ``echo``, the prompt's tokens come first, each with the decoder's
log-probability of it at its position (every position has one here, the first included, where
OpenAI's left-to-right models give null). OpenAI parameters that mean nothing to a diffusion sampler (best_of, the
penalties, logit_bias, suffix) are accepted only at the value that asks for nothing, else refused
(400) naming the parameter; unknown fields are refused too, and null in an optional field is its default. How
well a completion follows its prompt depends on the trained model: a random-init checkpoint gives
gibberish. With ``stream: true`` every choice comes as one OpenAI
chunk once its text is final (diffusion has no left-to-right deltas), then ``data: [DONE]``; with
``stream_options.continuous_usage_stats`` each chunk carries the usage so far.
Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``.
"""

# No `from __future__ import annotations`: the body model carries this server's limits, so it is built
# per app, and FastAPI reads a handler's parameter types from its live annotations.

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from ldlm import __version__
from ldlm.model.tokenizer import END_OF_TEXT, TextTokenizer
from ldlm.pipeline import TextResult
from ldlm.sampling import GenerateRequest
from ldlm.sampling.request import DEFAULT_SEED
from ldlm.sampling.tokens import TokenLogprobs, TokenSampling
from ldlm.serve.api.errors import REQUEST_ERRORS, HTTPError, error_status, openai_error
from ldlm.serve.api.offload import Deadline, json_response, run_blocking, run_submit, wait
from ldlm.serve.api.openai_schemas import (
    MODEL_ID,
    DetokenizeBody,
    DetokenizeResponse,
    StreamOptions,
    TokenizeBody,
    TokenizeResponse,
    VersionResponse,
    check_supported,
    completion_body,
    is_token_id,
    prompt_list,
    token_ids,
    token_sampling,
)
from ldlm.serve.api.service import LDLMService
from ldlm.serve.api.streaming import SSE_HEADERS, sse
from ldlm.serve.runtime.tracing import CURRENT, RequestTrace


@dataclass(frozen=True)
class PreparedPrompt:
    """One prompt of a completion request, ready to queue."""

    ids: list[int]  # its token ids (none: unconditional)
    text: str  # as ``echo`` shows it: the text given, or a token-id prompt decoded
    request: GenerateRequest  # its n choices
    decoding: TokenSampling | None  # how their tokens are chosen (None: argmax)


Prepared = list[PreparedPrompt]


def create_router(service: LDLMService) -> APIRouter:
    config = service.config
    CompletionBody = completion_body(service.body_limits())
    completer = Completions(service)
    router = APIRouter()
    created = int(time.time())

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The served model, as OpenAI lists models; ``max_model_len`` (its max_seq_len) as vLLM adds it."""
        return {
            "object": "list",
            "data": [{"id": MODEL_ID, "object": "model", "created": created, "owned_by": "ldlm", "max_model_len": config.max_seq_len}],
        }

    @router.post("/v1/completions", summary="OpenAI-compatible completions")
    async def completions(body: CompletionBody) -> Response:  # type: ignore[valid-type]
        """OpenAI completions by a diffusion model; see the module docs for how prompts condition."""
        return await completer.answer(body)

    add_vllm_routes(router, service)
    return router


def add_vllm_routes(router: APIRouter, service: LDLMService) -> None:
    """vLLM's additions to the OpenAI API, which its clients, benchmarks and load balancers call."""
    tokenizer, config, timeout_s = service.pipeline.tokenizer, service.config, service.settings.request_timeout_s

    @router.get("/health", summary="200 when ready, else 503 (vLLM's probe)", responses={503: {"description": "not ready"}})
    async def health() -> Response:
        return Response(status_code=200 if service.ready else 503)

    @router.get("/version", response_model=VersionResponse, summary="the server's version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @router.post("/v1/tokenize", response_model=TokenizeResponse, summary="a prompt's token ids, as /v1/completions reads it")
    async def tokenize(body: TokenizeBody) -> Response:
        check_model(body.model)
        ids = await run_blocking(prompt_ids, tokenizer, body.prompt, "prompt", timeout_s=timeout_s)
        spelled = [tokenizer.tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
        return await json_response(service, {"count": len(ids), "max_model_len": config.max_seq_len, "tokens": ids, "token_strs": spelled})

    @router.post("/v1/detokenize", response_model=DetokenizeResponse, summary="token ids' text")
    async def detokenize(body: DetokenizeBody) -> Response:
        check_model(body.model)

        def text() -> str:
            return ids_text(tokenizer, token_ids(body.tokens, "tokens", config.gpt2_vocab_size))

        return await json_response(service, {"prompt": await run_blocking(text, timeout_s=timeout_s)})


def check_model(model: str | None) -> None:
    """404 for a model this server does not serve (None: the request names none, as vLLM's tokenize allows)."""
    if model is not None and model != MODEL_ID:
        raise HTTPError(404, f"model {model!r} does not exist; available: {MODEL_ID}", param="model")


def prompt_ids(tokenizer: TextTokenizer, text: str, name: str) -> list[int]:
    """A text prompt's GPT-2 token ids: none for "" (unconditional); a blank text is refused, named as the request names it."""
    if text == "":
        return []
    if not text.strip():
        raise HTTPError(400, f'{name}={text!r} is blank; allowed: text with a non-space character, or "" for none', param="prompt")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate, which JSON's \ud800 escape carries; the tokenizer raises a TypeError
        raise HTTPError(
            400, f"{name} is not valid Unicode ({error.reason} at character {error.start}); allowed: UTF-8 text", param="prompt"
        ) from None
    return tokenizer.encode([text])[0]


def ids_text(tokenizer: TextTokenizer, ids: Sequence[int]) -> str:
    """Token ids' whole text, each end-of-text token spelled ``<|endoftext|>`` (as its text tokenizes back to it);
    ``TextTokenizer.decode`` alone stops at the first."""
    eos, pieces, start = tokenizer.eos_token_id, [], 0
    for k, token in enumerate(ids):
        if token == eos:
            pieces.append(tokenizer.decode(ids[start:k]))
            start = k + 1
    return END_OF_TEXT.join([*pieces, tokenizer.decode(ids[start:])])


class Completions:
    """The work behind POST /v1/completions: prompts -> scheduler requests -> OpenAI choices, whole or streamed."""

    def __init__(self, service: LDLMService) -> None:
        self.service = service
        self.settings, self.config, self.pipeline = service.settings, service.config, service.pipeline

    def prepare(self, body: Any) -> Prepared:
        """Per prompt: its token ids and the scheduler request (off the loop: tokenizing is work)."""
        settings, config, tokenizer = self.settings, self.config, self.pipeline.tokenizer
        check_model(body.model)
        check_supported(body)
        prompts = prompt_list(body.prompt, settings.max_texts, config.gpt2_vocab_size)
        if len(prompts) * body.n > settings.max_n:
            raise HTTPError(
                400, f"{len(prompts)} prompts x n={body.n} is {len(prompts) * body.n} choices; allowed: up to {settings.max_n} per request"
            )
        one = isinstance(body.prompt, str) or is_token_id(body.prompt[0])  # named "prompt", not "prompt[0]"
        seed = DEFAULT_SEED if body.seed is None else body.seed  # no seed: the same as on every path (ldlm.sampling.resolve)
        has_logits = getattr(self.pipeline.graphs, "has_logits", True)
        prepared = []
        for i, prompt in enumerate(prompts):
            name = "prompt" if one else f"prompt[{i}]"
            row = prompt_ids(tokenizer, prompt, name) if isinstance(prompt, str) else prompt
            if len(row) + body.max_tokens > config.max_seq_len:
                raise HTTPError(
                    400,
                    f"{name} has {len(row)} tokens and max_tokens is {body.max_tokens}: {len(row) + body.max_tokens} "
                    f"tokens in all; allowed: up to {config.max_seq_len} (the model's max_seq_len)",
                    param="prompt",
                )
            spec = body.to_request(len(row), (seed + i) % 2**63)
            text = prompt if isinstance(prompt, str) else ids_text(tokenizer, prompt)
            prepared.append(PreparedPrompt(row, text, spec, token_sampling(body, spec.seed, has_logits, row)))
        return prepared

    def prefix_latents(self, prepared: Prepared) -> list[torch.Tensor | None]:
        return [None if not p.ids else self.pipeline.encode([p.ids]).latents[0].cpu() for p in prepared]

    def choices(self, prompt: PreparedPrompt, result: TextResult, first_index: int, body: Any) -> tuple[list[dict[str, Any]], int]:
        """The text after the prompt, cut at end-of-text and before the first stop text (``stop``),
        preceded by the prompt with ``echo``; and the completion tokens counted."""
        out, used = [], 0
        eos, row = self.config.eos_token_id, prompt.ids
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        for j, ids in enumerate(result.token_ids[:, len(row) :].tolist()):
            end = completion_end(ids, eos, body)
            stop = end is not None
            ids = ids[:end]
            text = self.pipeline.tokenizer.decode([token for token in ids if token != eos])  # as vLLM skips special tokens
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if cut >= 0:  # the tokens counted are those of the text returned (which may be blank)
                text, stop = text[:cut], True
            used += self.pipeline.tokenizer.count_tokens(text) if cut >= 0 else len(ids)
            logprobs = None
            if body.logprobs is not None and result.logprobs is not None:
                start = len(prompt.text) if body.echo else 0
                logprobs = choice_logprobs(self.pipeline.tokenizer, ids, result.logprobs, (j, len(row)), start, cut if cut >= 0 else None)
                if body.echo:  # the prompt's tokens first, each with the decoder's log-probability at its position
                    echoed = choice_logprobs(self.pipeline.tokenizer, row, result.logprobs, (j, 0), 0, None)
                    logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
            out.append(
                {
                    "text": prompt.text + text if body.echo else text,
                    "index": first_index + j,
                    "logprobs": logprobs,
                    "finish_reason": "stop" if stop else "length",
                }
            )
        return out, used

    def submit(
        self, prepared: Prepared, prefixes: list[torch.Tensor | None], deadline: Deadline, trace: RequestTrace | None = None
    ) -> list[Future[TextResult]]:
        """Queue every prompt's request, all or none (off the loop: each draws its samples' prior noise), as part of
        ``trace``'s request (None: untraced). When one fails (a full queue: 503 by GuardMiddleware), those already
        queued are cancelled, or they would run for nobody."""
        futures: list[Future[TextResult]] = []
        try:
            for prompt, prefix in zip(prepared, prefixes):
                left = deadline.left()
                futures.append(
                    self.service.submit_generation(prompt.request, prefix, deadline_s=left, decoding=prompt.decoding, trace=trace)
                )
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return futures

    async def start(self, body: Any, deadline: Deadline) -> tuple[Prepared, list[Future[TextResult]]]:
        try:
            prepared = await run_blocking(self.prepare, body, timeout_s=deadline.left())
            prefixes = await run_blocking(self.prefix_latents, prepared, timeout_s=deadline.left())
        except ValueError as error:  # the tokenizer's and pipeline's messages name the bad value
            raise HTTPError(400, str(error)) from None
        futures = await run_submit(
            self.submit,
            prepared,
            prefixes,
            deadline,
            CURRENT.get(),
            cancel=lambda queued: [f.cancel() for f in queued],
            timeout_s=deadline.left(),
        )
        return prepared, futures

    async def answer(self, body: Any) -> Response:
        """The whole completion as one JSON answer, or (``stream: true``) as OpenAI chunks."""
        deadline = Deadline(self.settings.request_timeout_s if body.timeout_s is None else body.timeout_s)
        prepared, futures = await self.start(body, deadline)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": MODEL_ID}
        trace = CURRENT.get()
        if trace is not None:
            trace.attributes["gen_ai.response.id"] = head["id"]
        prompt_tokens = sum(len(prompt.ids) for prompt in prepared)  # once per prompt, whatever n (as vLLM counts)
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
        for i, (prompt, result) in enumerate(zip(prepared, results)):
            got, n_used = self.choices(prompt, result, i * body.n, body)
            every += got
            used += n_used
        plan = {"ldlm_plan": results[0].plan.summary()} if results and results[0].plan is not None else {}
        traced_usage(prompt_tokens, used)
        return await json_response(self.service, {**head, "choices": every, "usage": usage(prompt_tokens, used), **plan})

    async def stream_chunks(
        self, head: dict[str, Any], prepared: Prepared, futures: list[Future[TextResult]], prompt_tokens: int, body: Any, deadline: Deadline
    ) -> AsyncIterator[bytes]:
        used, options = 0, body.stream_options or StreamOptions()
        pending = {asyncio.ensure_future(wait(asyncio.wrap_future(f), deadline.left(), deadline.limit_s)): i for i, f in enumerate(futures)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    result = task.result()
                    got, n_used = self.choices(prepared[i], result, i * body.n, body)
                    used += n_used
                    plan = {} if result.plan is None else {"ldlm_plan": result.plan.summary()}
                    so_far = {"usage": usage(prompt_tokens, used)} if options.continuous_usage_stats else {}
                    yield sse({**head, "choices": got, **plan, **so_far})
            traced_usage(prompt_tokens, used)
            if options.include_usage:
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


def completion_end(ids: list[int], eos: int, body: Any) -> int | None:
    """Where a choice's completion ends: at its first end-of-text token from position ``min_tokens`` on (None: it
    runs to max_tokens); with ``ignore_eos``, never there. Every position was sampled either way: an end-of-text token
    that ends nothing stays in the choice's tokens, counted in usage as vLLM counts every token it generated."""
    if body.ignore_eos or eos not in ids[body.min_tokens :]:
        return None
    return ids.index(eos, body.min_tokens)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def traced_usage(prompt_tokens: int, completion_tokens: int) -> None:
    """A traced completion's usage, as its span's GenAI attributes (the tokens of the texts returned, as ``usage``)."""
    trace = CURRENT.get()
    if trace is not None:
        trace.attributes.update({"gen_ai.usage.input_tokens": prompt_tokens, "gen_ai.usage.output_tokens": completion_tokens})


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
