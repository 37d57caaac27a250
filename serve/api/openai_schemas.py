"""The request body of OpenAI's completions, as this diffusion model can honour it.

``temperature``, ``top_p`` and ``logprobs`` act at the token decoder, which gives a distribution over
tokens at every position (ldlm/sampling/tokens.py); temperature 0, the default, is its argmax. OpenAI
parameters that mean nothing to a diffusion sampler are accepted only at the value that asks
for nothing, else refused (400) naming the parameter; LDLM's own (steps, sampler, t_min, timeout_s)
are extra body fields. The body carries this server's limits, so ``completion_body`` builds it per app.
OpenAI documents its optional fields as "or null", and its client sends null for an argument given as
None: null in any optional field is that field's default, as if left out (``NullIsDefault``). vLLM's
extensions that benchmarks send (``ignore_eos``, ``min_tokens``, ``stream_options.continuous_usage_stats``)
are taken with their meaning for a sampler that writes every position at once.

``prompt`` takes OpenAI's four forms: a text, a list of texts, a list of token ids, a list of token-id
lists; ``prompt_list`` reads them (the body types the field loosely, so that a mixed or empty list is
refused with one message naming the forms, not with one per form). vLLM's additions to the API
(/v1/tokenize, /v1/detokenize, /version) have their bodies here too, as vLLM keeps them beside its
OpenAI protocol.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, Field, StrictInt, WithJsonSchema, create_model, model_validator

from ldlm.limits import TEMPERATURE, TOP_LOGPROBS, TOP_P
from ldlm.sampling import GenerateRequest
from ldlm.sampling.tokens import TokenSampling
from ldlm.serve.api.errors import HTTPError
from ldlm.serve.api.schemas import STRICT_BODY, BodyLimits, SamplingBody, ranged, sampling_fields, shown, timeout_field

MODEL_ID = "ldlm"


class NullIsDefault(BaseModel):
    """A body whose optional fields take null as their default (a required field's null is still refused).
    The default lives on the field alone; null is dropped before validation, so the field's own applies."""

    @model_validator(mode="before")
    @classmethod
    def null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # not an object: refused by validation, naming what is allowed
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class StreamOptions(NullIsDefault):
    model_config = STRICT_BODY
    include_usage: bool | None = Field(default=False, strict=True, description="a last chunk, before [DONE], with no choices and the usage")
    continuous_usage_stats: bool | None = Field(
        default=False,
        strict=True,
        description="vLLM's: every chunk also carries the usage so far (the request's prompt tokens, the tokens sent)",
    )


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

PROMPT_FORMS = "a text, a list of texts, a list of token ids, or a list of token-id lists"
# What /docs shows for ``prompt``: OpenAI's four forms, or null for the default. The field itself takes any
# JSON, and ``prompt_list`` refuses what is none of them.
TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        TOKEN_IDS_SCHEMA,
        {"type": "array", "items": TOKEN_IDS_SCHEMA, "minItems": 1},
        {"type": "null"},
    ]
}


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
# vLLM's extensions that its clients and benchmarks send. The sampler writes all max_tokens positions at
# once, so neither changes what is sampled: only where a choice's completion ends (``completion_end``).
VLLM_FIELDS: dict[str, Any] = {
    "ignore_eos": (
        bool | None,
        Field(
            False,
            strict=True,
            description="vLLM's: true: an end-of-text token does not end a choice, which is then max_tokens tokens "
            "(end-of-text tokens are counted, not shown in the text)",
        ),
    ),
}
OPENAI_ORDER = ("temperature", "top_p", "best_of", "logprobs", "frequency_penalty", "presence_penalty", "logit_bias", "suffix")


class CompletionFields(SamplingBody, NullIsDefault):
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
            Annotated[Any, WithJsonSchema(PROMPT_SCHEMA)],
            Field(
                "",
                description=f"what to continue: {PROMPT_FORMS} (GPT-2 ids; see POST /v1/tokenize); '' generates "
                f"unconditionally; a list of 1..{limits.max_texts} prompts gives n choices each, prompt by prompt",
            ),
        ),
        max_tokens=(
            int | None,
            ranged(
                r["max_tokens"], 16, f"completion tokens; prompt tokens + max_tokens must fit the model's max_seq_len ({r['max_tokens']})"
            ),
        ),
        min_tokens=(int | None, ranged(r["min_tokens"], 0, "vLLM's: an end-of-text token in a choice's first min_tokens ends nothing")),
        n=(int | None, ranged(r["n"], 1, f"choices per prompt ({r['n']} in all)")),
        seed=(
            int | None,
            ranged(
                r["seed"],
                None,
                f"noise seed ({r['seed']}; default: 0, as on every path, so a request names its answer; prompt i of a list runs seed + i)",
            ),
        ),
        stream=(bool | None, Field(False, strict=True, description="OpenAI server-sent chunks, ending with data: [DONE]")),
        stream_options=(
            StreamOptions | None,
            Field(
                None,
                description="with stream: true only; include_usage: a last chunk with usage; continuous_usage_stats: usage in every chunk",
            ),
        ),
        stop=(
            str | list[str] | None,
            Field(None, description=f'up to {MAX_STOP} texts: a choice ends before the first of them (finish_reason "stop")'),
        ),
        echo=(bool | None, Field(False, strict=True, description="the prompt, then the completion, in each choice's text")),
        user=(str | None, Field(None, description="an end-user id, as OpenAI's; it does not change the output")),
        **VLLM_FIELDS,
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
    """Refuse a parameter this model cannot honour, or one out of range for the others (min_tokens past max_tokens,
    stream_options without a stream), naming it (OpenAI's ``param``)."""
    for name, (allowed, why) in UNSUPPORTED.items():
        value = getattr(body, name)
        if not any(value == a and type(value) is not bool for a in allowed) and value is not None:
            raise HTTPError(
                400,
                f"{name}={json.dumps(value)} is not supported by this diffusion model ({why}); allowed: {accepted(allowed)}",
                param=name,
            )
    if not 0 <= body.min_tokens <= body.max_tokens:  # as vLLM refuses min_tokens > max_tokens
        raise HTTPError(
            400,
            f"min_tokens={body.min_tokens} is out of range; allowed: 0..{body.max_tokens} (max_tokens, the tokens each choice has)",
            param="min_tokens",
        )
    if body.stream_options is not None and not body.stream:  # vLLM's refusal, in its words
        raise HTTPError(
            400,
            f"Stream options can only be defined when `stream=True`; stream_options was given with stream={json.dumps(body.stream)}",
            param="stream_options",
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


# --- prompts: OpenAI's four forms -----------------------------------------------------------------

Prompt = str | list[int]  # one prompt: a text, or its token ids


def prompt_list(prompt: Any, max_prompts: int, vocabulary: int) -> list[Prompt]:
    """The request's prompts, each a text or its token ids, from any of OpenAI's four forms (a list of
    token ids is one prompt). Refused (400) naming what is allowed: another JSON value, an empty list, a
    list that mixes the forms, more than ``max_prompts`` prompts, a token id outside 0..vocabulary - 1."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise prompt_error(f"prompt is {kind_of(prompt)}", max_prompts)
    if is_token_id(prompt[0]):
        return [token_ids(prompt, "prompt", vocabulary)]
    if len(prompt) > max_prompts:  # before a long list is walked
        raise HTTPError(400, f"prompt has {len(prompt)} items; allowed: 1..{max_prompts}", param="prompt")
    if isinstance(prompt[0], str):
        for i, text in enumerate(prompt):
            if not isinstance(text, str):
                raise prompt_error(f"prompt[{i}] is {kind_of(text)} in a list of texts", max_prompts)
        return list(prompt)
    if isinstance(prompt[0], list):
        rows: list[Prompt] = []
        for i, row in enumerate(prompt):
            if not isinstance(row, list) or not row:
                raise prompt_error(f"prompt[{i}] is {kind_of(row)} in a list of token-id lists", max_prompts)
            rows.append(token_ids(row, f"prompt[{i}]", vocabulary))
        return rows
    raise prompt_error(f"prompt[0] is {kind_of(prompt[0])}", max_prompts)


def token_ids(values: list[Any], name: str, vocabulary: int) -> list[int]:
    """``values``, each an integer token id in 0..vocabulary - 1, or 400 naming the first that is not
    (``name``: how the request names the list, ``prompt[2]`` or ``tokens``)."""
    param = name.split("[")[0]
    for j, token in enumerate(values):
        if not is_token_id(token):
            raise HTTPError(400, f"{name}[{j}] is {kind_of(token)}; allowed: token ids, integers 0..{vocabulary - 1}", param=param)
        if not 0 <= token < vocabulary:
            raise HTTPError(400, f"{name}[{j}]={token} is out of the vocabulary; allowed: token ids 0..{vocabulary - 1}", param=param)
    return values


def is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON's true is no token


def kind_of(value: Any) -> str:
    """A JSON value as a message names it: 'a number (1.5)', 'an empty list', 'a text ("Once up...")'."""
    if isinstance(value, str):
        return f"a text ({shown(value if len(value) <= 20 else value[:20] + '...')})"
    if isinstance(value, list):
        return "a list" if value else "an empty list"
    if isinstance(value, dict):
        return "an object"
    return "null" if value is None else f"{'a boolean' if isinstance(value, bool) else 'a number'} ({shown(value)})"


def prompt_error(problem: str, max_prompts: int) -> HTTPError:
    return HTTPError(
        400,
        f"{problem}; allowed: a text, a list of 1..{max_prompts} texts, a list of token ids, or a list of 1..{max_prompts} "
        'token-id lists, one form per request ("" samples unconditionally)',
        param="prompt",
    )


# --- vLLM's additions: tokenize, detokenize, version -------------------------------------------------

MODEL_FIELD = Field(None, description=f"the served model's id, {MODEL_ID!r}, or null")


class TokenizeBody(BaseModel):
    """POST /v1/tokenize, as vLLM takes it (its TokenizeCompletionRequest)."""

    model_config = STRICT_BODY
    model: str | None = MODEL_FIELD
    prompt: str = Field(..., strict=True, description='the text; "" has no tokens, a blank text is refused as a prompt is')
    add_special_tokens: bool = Field(
        True, strict=True, description="as vLLM's; GPT-2's tokenizer adds no special tokens (no BOS), so either gives the same ids"
    )
    return_token_strs: bool | None = Field(
        False, strict=True, description="also each token as the tokenizer's vocabulary spells it (byte-level BPE: 'Ġ' is a space)"
    )


class TokenizeResponse(BaseModel):
    count: int = Field(..., description="how many tokens")
    max_model_len: int = Field(..., description="the model's max_seq_len: prompt tokens + max_tokens must fit it")
    tokens: list[int] = Field(..., description="the GPT-2 token ids /v1/completions conditions on for this prompt")
    token_strs: list[str] | None = Field(None, description="with return_token_strs: each token's vocabulary entry")


class DetokenizeBody(BaseModel):
    """POST /v1/detokenize, as vLLM takes it (its DetokenizeRequest)."""

    model_config = STRICT_BODY
    model: str | None = MODEL_FIELD
    tokens: list[StrictInt] = Field(..., description="GPT-2 token ids, each in the tokenizer's vocabulary")


class DetokenizeResponse(BaseModel):
    prompt: str = Field(..., description="the ids' text, an end-of-text token as <|endoftext|>")


class VersionResponse(BaseModel):
    version: str = Field(..., description="the ldlm package's version")
