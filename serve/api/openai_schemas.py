"""The request body of OpenAI's completions, as this diffusion model can honour it.

``temperature``, ``top_p`` and ``logprobs`` act at the token decoder, which gives a distribution over
tokens at every position (ldlm/token_sampling.py); temperature 0, the default, is its argmax. OpenAI
parameters that mean nothing to a diffusion sampler are accepted only at the value that asks
for nothing, else refused (400) naming the parameter; LDLM's own (steps, sampler, t_min, timeout_s)
are extra body fields. The body carries this server's limits, so ``completion_body`` builds it per app.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field, create_model

from ldlm.config import SAMPLERS
from ldlm.limits import MAX_SEED
from ldlm.serve.api.errors import HTTPError
from ldlm.serve.api.schemas import (
    PRIOR_TEMPERATURE_RANGE,
    STRICT_BODY,
    T_MIN_RANGE,
    BodyLimits,
    Range,
    SamplerName,
    sampling_fields,
    strict_int,
    timeout_field,
)
from ldlm.serve.api.service import ServerSettings
from ldlm.token_sampling import MAX_TEMPERATURE, MAX_TOP_LOGPROBS, TokenSampling

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


# The token decoder's own: how each token is chosen from its distribution (ldlm/token_sampling.py).
DECODING_FIELDS: dict[str, Any] = {
    "temperature": (
        float | None,
        Field(
            None,
            ge=0,
            le=MAX_TEMPERATURE,
            strict=True,
            description="0 (the default): each token is the decoder's argmax; > 0: drawn from softmax(logits / temperature), seeded by seed",
        ),
    ),
    "top_p": (
        float | None,
        Field(None, gt=0, le=1, strict=True, description="with temperature > 0: draw from the smallest set of tokens holding this mass"),
    ),
    "logprobs": (
        int | None,
        Field(
            None,
            ge=0,
            le=MAX_TOP_LOGPROBS,
            strict=True,
            description="each completion token's log-probability under the decoder, and this many most likely alternatives",
        ),
    ),
}
OPENAI_ORDER = ("temperature", "top_p", "best_of", "logprobs", "frequency_penalty", "presence_penalty", "logit_bias", "suffix")


def completion_body(limits: BodyLimits) -> type[BaseModel]:
    unsupported = {
        name: (Any, Field(None, description=f"not supported ({why}); allowed: {accepted(allowed)}"))
        for name, (allowed, why) in UNSUPPORTED.items()
    }
    openai_fields = {**DECODING_FIELDS, **unsupported}
    openai_fields = {name: openai_fields[name] for name in OPENAI_ORDER}  # as OpenAI's reference lists them
    return create_model(  # type: ignore[call-overload, unused-ignore]  # pydantic's stubs cannot type fields built in a dict
        "CompletionBody",
        __config__=STRICT_BODY,
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
            strict_int(
                16,
                1,
                limits.max_seq_len,
                f"completion tokens; prompt tokens + max_tokens must fit the model's max_seq_len ({limits.max_seq_len})",
            ),
        ),
        n=(int, strict_int(1, 1, limits.max_n, f"choices per prompt (1..{limits.max_n} in all)")),
        seed=(
            int | None,
            Field(None, ge=0, le=MAX_SEED, strict=True, description="noise seed; with sampler ddim the same seed gives the same text"),
        ),
        stream=(bool, Field(False, strict=True, description="OpenAI server-sent chunks, ending with data: [DONE]")),
        stream_options=(StreamOptions | None, Field(None, description="include_usage: a last chunk with usage")),
        stop=(
            str | list[str] | None,
            Field(None, description=f'up to {MAX_STOP} texts: a choice ends before the first of them (finish_reason "stop")'),
        ),
        echo=(bool, Field(False, strict=True, description="the prompt, then the completion, in each choice's text")),
        user=(str | None, Field(None, description="an end-user id, as OpenAI's; it does not change the output")),
        steps=(
            int,
            strict_int(
                limits.default_steps, 1, limits.max_steps, f"LDLM: denoising steps (1..{limits.max_steps}; default: the model config's)"
            ),
        ),
        sampler=(
            SamplerName,
            Field(limits.default_sampler, description=f"LDLM: one of {', '.join(SAMPLERS)}; default: the model config's"),
        ),
        **sampling_fields("LDLM: "),
        timeout_s=(float | None, timeout_field(limits.max_timeout_s)),
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


def openai_limits(settings: ServerSettings, max_seq_len: int) -> dict[str, Range]:
    """The ranges that validation messages name, field by field."""
    return {
        "max_tokens": Range(1, max_seq_len),
        "n": Range(1, settings.max_n),
        "steps": Range(1, settings.max_steps),
        "seed": Range(0, MAX_SEED),
        "t_min": T_MIN_RANGE,
        "prior_temperature": PRIOR_TEMPERATURE_RANGE,
        "temperature": Range(0, MAX_TEMPERATURE),
        "top_p": Range(0, 1, low_open=True),
        "logprobs": Range(0, MAX_TOP_LOGPROBS),
        "timeout_s": Range(0, settings.request_timeout_s, low_open=True),
    }
