"""The text API: texts in, texts, token ids or latents out.

  POST /v1/generate      sample texts (``stream: true``: Server-Sent Events with denoising previews;
                         ``prompt``, where the body has it: continue it, as in serve/api/prompted.py)
  POST /v1/reconstruct   texts -> latents -> texts
  POST /v1/encode        texts -> standardized latents and their attention mask

Generation goes through the service's step-level scheduler; reconstruct and encode through the
graphs' dynamic batchers.
"""

# No `from __future__ import annotations`: the body models carry this server's limits, so they are
# built per app, and FastAPI reads a handler's parameter types from its live annotations.

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response, StreamingResponse

from ldlm.pipeline import LDLMPipeline
from ldlm.serve.api.errors import HTTPError
from ldlm.serve.api.offload import Deadline, json_response, run_blocking
from ldlm.serve.api.schemas import EncodeResponse, GenerateResponse, RequestModels, TextsResponse, request_models
from ldlm.serve.api.service import LDLMService
from ldlm.serve.api.streaming import SSE_HEADERS, generate_sse, generate_texts, ran, start_stream


def text_request_models(service: LDLMService) -> RequestModels:
    """The /v1 bodies with this server's limits and the model config's defaults."""
    return request_models(service.body_limits())


def create_router(service: LDLMService, models: RequestModels) -> APIRouter:
    """The /v1 text routes, their bodies validated by ``models`` (see ``text_request_models``)."""
    settings = service.settings
    router = APIRouter()
    # Any to a type checker: built at run time, these are types only to pydantic and FastAPI
    GenerateBody: Any = models.generate
    TextsBody: Any = models.texts

    async def generate(body: GenerateBody) -> Response:
        """Sample texts. Random-init checkpoints give gibberish. With `stream: true`: Server-Sent Events."""
        deadline = Deadline(settings.request_timeout_s if body.timeout_s is None else body.timeout_s)
        prompt, tokenizer = getattr(body, "prompt", ""), service.pipeline.tokenizer  # a body model without the field: none
        if not body.stream:
            result = await generate_texts(service, body.to_request(), prompt, deadline)
            return await json_response(service, {"texts": result.texts, "token_ids": result.ids(), "plan": ran(result)})
        stream, _, _ = await start_stream(service, body.to_request(), prompt, body.preview_every, deadline, "/v1/generate")
        return StreamingResponse(generate_sse(stream, deadline.left(), tokenizer), headers=SSE_HEADERS, media_type="text/event-stream")

    async def answer_texts(body: Any, payload: Callable[[LDLMPipeline, list[list[int]]], dict[str, Any]]) -> Response:
        """Check and tokenize the body's texts and compute ``payload`` of their ids, in one call off the
        loop (each text is tokenized once); answer with its JSON."""
        texts = list(body.texts)

        def run() -> dict[str, Any]:
            return payload(service.pipeline, checked_ids(texts, service.pipeline))

        return await json_response(service, await run_blocking(run, timeout_s=settings.request_timeout_s))

    async def reconstruct(body: TextsBody) -> Response:
        """Texts -> latents -> texts."""
        return await answer_texts(body, reconstruction)

    async def encode(body: TextsBody) -> Response:
        """Texts -> standardized latents (B, L, D) and their attention mask."""
        return await answer_texts(body, encoding)

    # registered here, not by decorators: each route's summary is its handler's docstring
    for path, handler, response_model in (
        ("/v1/generate", generate, GenerateResponse),
        ("/v1/reconstruct", reconstruct, TextsResponse),
        ("/v1/encode", encode, EncodeResponse),
    ):
        router.post(path, response_model=response_model, summary=handler.__doc__)(handler)
    return router


def checked_ids(texts: list[str], pipeline: LDLMPipeline) -> list[list[int]]:
    """Each text's token ids, its problems named as the request names it (``texts[3]``): valid Unicode,
    and at most max_seq_len tokens (``LDLMPipeline.text_ids``; its ValueError answers 400)."""
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise HTTPError(
                400, f"texts[{i}] is not valid Unicode ({error.reason} at character {error.start}); allowed: UTF-8 text"
            ) from None
    return pipeline.text_ids(texts)


def reconstruction(pipeline: LDLMPipeline, ids: list[list[int]]) -> dict[str, Any]:
    result = pipeline.reconstruct(ids)
    return {"texts": result.texts, "token_ids": result.ids()}  # each text's own ids, no padded positions


def encoding(pipeline: LDLMPipeline, ids: list[list[int]]) -> dict[str, Any]:
    result = pipeline.encode(ids)
    return {"shape": list(result.latents.shape), "latents": result.latents.numpy(), "attention_mask": result.attention_mask.long().numpy()}
