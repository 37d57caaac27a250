"""The request body of OpenAI's completions, as this diffusion model can honour it.

``temperature``, ``top_p`` and ``logprobs`` act at the token decoder, which gives a distribution over
tokens at every position (ldlm/sampling/tokens.py); temperature 0, the default, is its argmax. OpenAI
parameters that mean nothing to a diffusion sampler are accepted only at the value that asks
for nothing, else refused (400) naming the parameter; LDLM's own (steps, sampler, t_min, timeout_s)
are extra body fields. The body carries this server's limits, so ``completion_body`` builds it per app.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field, create_model

from ldlm.limits import TEMPERATURE, TOP_LOGPROBS, TOP_P
from ldlm.sampling import GenerateRequest
from ldlm.sampling.tokens import TokenSampling
from ldlm.serve.api.errors import HTTPError
from ldlm.serve.api.schemas import STRICT_BODY, BodyLimits, SamplingBody, ranged, sampling_fields, timeout_field

MODEL_ID = "ldlm"


class StreamOptions(BaseModel):
    model_config = STRICT_BODY
    include_usage: bool = Field(False, strict=True)


# OpenAI parameters a diffusion sampler has no use for. Each is accepted only at the value that asks
# for nothing (OpenAI's own default), so a client that leaves them alone works; any other value is
# refused with OpenAI's error shape naming the parameter, never silently ignored.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "completions are not scored; ask for n choices instead"),
    "frequency_penalty": ((None, 0, 0.0), "tokens are not sampled one at a time"),
    "presence_penalty": ((None, 0, 0.0), "tokens are not sampled one at a time"),
    "logit_bias": ((None, {}), "tokens are not sampled from logits one at a time"),
    "suffix": ((None, ""), "only prefix prompts (inpainting at the start) are supported"),
}
MAX_STOP = 4  # as OpenAI: up to 4 stop sequences


# The token decoder's own: how each token is chosen from its distribution (ldlm/sampling/tokens.py).
DECODING_FIELDS: dict[str, Any] = {
    "temperature": (
        float | None,
        ranged(
            TEMPERATURE,
            None,
            f"{TEMPERATURE}; 0 (the default): each token is the decoder's argmax; > 0: drawn from softmax(logits / temperature), "
            "seeded by seed",
        ),
    ),
    "top_p": (
        float | None,
        ranged(TOP_P, None, f"{TOP_P}; with temperature > 0: draw from the smallest set of tokens holding this mass"),
    ),
    "logprobs": (
        int | None,
        ranged(
            TOP_LOGPROBS,
            None,
            f"{TOP_LOGPROBS}: each completion token's log-probability under the decoder, and this many most likely alternatives",
        ),
    ),
}
OPENAI_ORDER = ("temperature", "top_p", "best_of", "logprobs", "frequency_penalty", "presence_penalty", "logit_bias", "suffix")


class CompletionFields(SamplingBody):
    """/v1/completions' body, as the handler reads it (its fields are built per app by ``completion_body``)."""

    def to_request(self, prompt_tokens: int, seed: int) -> GenerateRequest:
        """The request of one prompt of ``prompt_tokens`` tokens: n choices of max_tokens tokens after it."""
        fields: Any = self
        return self.sampling_request(fields.n, prompt_tokens + fields.max_tokens, seed)


def completion_body(limits: BodyLimits) -> type[BaseModel]:
    r = limits.ranges()
    unsupported = {
        name: (Any, Field(None, description=f"not supported ({why}); allowed: {accepted(allowed)}"))
        for name, (allowed, why) in UNSUPPORTED.items()
    }
    openai_fields = {**DECODING_FIELDS, **unsupported}
    openai_fields = {name: openai_fields[name] for name in OPENAI_ORDER}  # as OpenAI's reference lists them
    return create_model(  # type: ignore[call-overload, unused-ignore]  # pydantic's stubs cannot type fields built in a dict
        "CompletionBody",
        __base__=CompletionFields,
        model=(str, Field(..., description=f"the served model's id: {MODEL_ID!r} (see GET /v1/models)")),
        prompt=(
            str | list[str],
            Field(
                "",
                description=f"text to continue; '' generates unconditionally; a list of 1..{limits.max_texts} prompts gives n choices each",
            ),
        ),
        max_tokens=(
            int,
            ranged(
                r["max_tokens"], 16, f"completion tokens; prompt tokens + max_tokens must fit the model's max_seq_len ({r['max_tokens']})"
            ),
        ),
        n=(int, ranged(r["n"], 1, f"choices per prompt ({r['n']} in all)")),
        seed=(
            int | None,
            ranged(r["seed"], None, f"noise seed ({r['seed']}; default: a random one, as OpenAI's); the same seed gives the same text"),
        ),
        stream=(bool, Field(False, strict=True, description="OpenAI server-sent chunks, ending with data: [DONE]")),
        stream_options=(StreamOptions | None, Field(None, description="include_usage: a last chunk with usage")),
        stop=(
            str | list[str] | None,
            Field(None, description=f'up to {MAX_STOP} texts: a choice ends before the first of them (finish_reason "stop")'),
        ),
        echo=(bool, Field(False, strict=True, description="the prompt, then the completion, in each choice's text")),
        user=(str | None, Field(None, description="an end-user id, as OpenAI's; it does not change the output")),
        **sampling_fields(limits, "LDLM: "),
        timeout_s=(float | None, timeout_field(limits)),
        **openai_fields,
    )


def accepted(allowed: tuple[Any, ...]) -> str:
    """(None, 1, 1.0) -> '1 or null'."""
    values: list[Any] = []
    for value in allowed:
        if value is not None and value not in values:  # 1.0 == 1: named once
            values.append(value)
    return " or ".join([*(json.dumps(v) for v in values), "null"])


def check_supported(body: Any) -> None:
    """Refuse a parameter this model cannot honour, naming it (OpenAI's ``param``)."""
    for name, (allowed, why) in UNSUPPORTED.items():
        value = getattr(body, name)
        if not any(value == a and type(value) is not bool for a in allowed) and value is not None:
            raise HTTPError(
                400,
                f"{name}={json.dumps(value)} is not supported by this diffusion model ({why}); allowed: {accepted(allowed)}",
                param=name,
            )
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOP or any(stop == "" for stop in stops):
        raise HTTPError(
            400,
            f"stop has {len(stops)} items{' with an empty one' if '' in stops else ''}; allowed: 1..{MAX_STOP} non-empty texts",
            param="stop",
        )


def token_sampling(body: Any, seed: int, has_logits: bool, prompt_ids: Sequence[int] = ()) -> TokenSampling | None:
    """The body's temperature, top_p and logprobs for the token decoder (None: argmax, as without them);
    with ``echo`` and ``logprobs``, the prompt's tokens are given, to report their log-probabilities.
    Drawing needs the decoder's logits: an export without them is refused here, naming the fix."""
    temperature = 0.0 if body.temperature is None else float(body.temperature)
    top_p = 1.0 if body.top_p is None else float(body.top_p)
    given = tuple(prompt_ids) if body.echo and body.logprobs is not None else ()
    sampling = TokenSampling(temperature, top_p, body.logprobs, seed, given)
    if sampling.needs_logits and not has_logits:
        name = "temperature" if temperature > 0 else "logprobs"
        raise HTTPError(
            400,
            f"{name}={json.dumps(getattr(body, name))} needs the token decoder's logits, and this server's export has no logits "
            "output; re-export with `ldlm export --with-logits` and serve that directory (or serve the checkpoint itself)",
            param=name,
        )
    return sampling if sampling.needs_logits else None
