"""The text API's request and response schemas, and the one error shape of every route.

Request limits depend on the server (``ServerSettings.max_n``, ``max_steps``, ``max_texts``) and
on the model (``max_seq_len``), so the request models are built per app by ``request_models``, each
bound read from the one table (``ldlm.limits.body_ranges``): the bounds are then both enforced and
visible in ``/openapi.json``. The fields a generation's plan is made of (sampler, steps, grid, t_min,
prior_temperature, seed) default to "not given" (null): ``ldlm.sampling.resolve`` fills them in, as for
the CLI and Python, and ``SamplingBody.sampling_request`` is the one way a body becomes a request.
Bodies are strict: unknown fields, booleans or floats for integers, and empty texts are refused (422)
with a message naming the field, the value and what is allowed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model
from pydantic_core import PydanticCustomError

from ldlm.limits import Range, body_ranges
from ldlm.model.config import GRIDS, SAMPLERS, TUNED_GRID
from ldlm.sampling import GenerateRequest


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx of every route: one message naming the bad value and the allowed range."""

    error: str = Field(..., description="what was wrong, the value given and what is allowed")


class TextsResponse(BaseModel):
    texts: list[str] = Field(..., description="one decoded text per sample")
    token_ids: list[list[int]] = Field(..., description="the decoded GPT-2 token ids, one list per sample, without padded positions")


class Plan(BaseModel):
    """The sampling plan that produced an answer: what the request gave, and what the server filled in."""

    sampler: str = Field(..., description="the sampler that ran")
    steps: int = Field(..., description="its denoiser calls per sample")
    grid: str = Field(..., description=f"its time grid: {TUNED_GRID} (the checkpoint's, from `ldlm tune-schedule`) or {', '.join(GRIDS)}")
    t_min: float = Field(..., description="the grid's last time")
    prior_temperature: float = Field(..., description="the prior's standard deviation tau")
    prompt_strength: float = Field(..., description="a prompt's guidance weight w (1: inpainting alone; no prompt: no effect)")


class GenerateResponse(TextsResponse):
    plan: Plan = Field(..., description="what ran: every field the request left out, as the server filled it in")


class EncodeResponse(BaseModel):
    shape: list[int] = Field(..., description="(B, L, D): texts, tokens of the longest text, latent width")
    latents: list[list[list[float]]] = Field(..., description="standardized latents, right-padded to L")
    attention_mask: list[list[int]] = Field(..., description="1 for a real token, 0 for padding")


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in {
        400: "malformed request",
        401: "missing or wrong bearer token",
        408: "body too slow",
        413: "body or request too large",
        422: "a field out of range",
        503: "queue full (Retry-After)",
        504: "timed out",
    }.items()
}


@dataclass(frozen=True)
class RequestModels:
    generate: type[BaseModel]
    texts: type[BaseModel]
    limits: dict[str, Range]  # field -> allowed range, for messages


# The sampler names a request may give: ldlm.model.config.SAMPLERS, the one list, as a type that pydantic
# validates and /openapi.json lists.
SamplerName = Literal[SAMPLERS]  # type: ignore[valid-type]
GridName = Literal[(TUNED_GRID, *GRIDS)]  # type: ignore[valid-type]
GRID_HELP = (
    f"step grid: {TUNED_GRID} (the checkpoint's, from `ldlm tune-schedule`), {', '.join(GRIDS)} "
    "(default: the tuned grid where one is tuned for the sampler and steps, else the sampler's own)"
)

# Request bodies are strict: an unknown (misspelled) field is an error naming it, not ignored, and a
# boolean or a float is not an integer ({"n": true} would otherwise run as n=1).
STRICT_BODY = ConfigDict(extra="forbid")


def ranged(allowed: Range, default: Any, description: str, strict: bool = True) -> Any:
    """A body field bounded by its range in the one table; strict: no booleans or floats for integers."""
    bounds: dict[str, Any] = allowed.field_bounds()
    return Field(default, strict=strict, description=description, **bounds)


class SamplingBody(BaseModel):
    """What /v1/generate's body and /v1/completions' share: the fields a generation's plan is made of."""

    model_config = STRICT_BODY

    def sampling_request(self, n: int, length: int, seed: int | None) -> GenerateRequest:
        """The request this body asks for, every field it leaves out left to ``ldlm.sampling.resolve``."""
        fields: Any = self
        return GenerateRequest(
            n, length, fields.steps, seed, fields.sampler, fields.t_min, fields.grid, fields.prior_temperature, fields.prompt_strength
        )


def sampling_fields(limits: BodyLimits, prefix: str = "") -> dict[str, Any]:
    """steps, sampler, t_min, grid, prior_temperature and prompt_strength as both request bodies take them
    (/v1/generate's, /v1/completions' extra_body), each null unless given; ``prefix`` marks fields that are LDLM's own."""
    r = limits.ranges()
    t, tau, w = r["t_min"], r["prior_temperature"], r["prompt_strength"]
    t_min = f"{prefix}last time of the grid: {t} (default: the model config's t_min)"
    prior = f"{prefix}the prior's standard deviation tau ({tau}): x_1 ~ N(0, tau^2 I); below 1 trades diversity for text "
    prior += "nearer the training data (default: the model config's prior_temperature, else 1)"
    strength = f"{prefix}the prompt's guidance weight w ({w}): each step also denoises the sample blind to the prompt and "
    strength += "moves its continuation to x0_blind + w (x0_prompted - x0_blind), at twice the denoiser work; 0 ignores the "
    strength += "prompt; no prompt: no effect (default: 1, inpainting alone)"
    defaults = f" (default: chosen by the server for the sampler; {limits.defaults})" if limits.defaults else ""
    return {
        "steps": (int | None, ranged(r["steps"], None, f"{prefix}denoising steps ({r['steps']}){defaults}")),
        "sampler": (
            SamplerName | None,
            Field(None, description=f"{prefix}one of {', '.join(SAMPLERS)} (default: the model config's default_sampler)"),
        ),
        "t_min": (float | None, ranged(t, None, t_min, strict=False)),
        "grid": (GridName | None, Field(None, description=f"{prefix}{GRID_HELP}")),
        "prior_temperature": (float | None, ranged(tau, None, prior, strict=False)),
        "prompt_strength": (float | None, ranged(w, None, strength, strict=False)),
    }


def timeout_field(limits: BodyLimits) -> Any:
    """A request's own deadline, shorter than the server's: refused up front if it cannot be met (the estimate is named)."""
    return ranged(
        limits.ranges()["timeout_s"],
        None,
        f"seconds this request may take, at most the server's {limits.max_timeout_s:g} s "
        "(its default): a request estimated to take longer is refused at once (413 or 503 with Retry-After), and one "
        "that runs past it is cancelled (504)",
        strict=False,
    )


def non_empty(text: str) -> str:
    """An empty text is a 422 like every other bad field. (A length constraint on the str would do this too,
    but pydantic then converts the text and refuses a lone surrogate with a parser message, where
    ``LDLMPipeline.text_ids`` names it.)"""
    if text == "":
        raise PydanticCustomError("string_too_short", "empty text")
    return text


@dataclass(frozen=True)
class BodyLimits:
    """What a request body may ask of this server (its settings and the model's max_seq_len), and, for
    the docs, what a request naming no sampler or steps gets (``LDLMService.default_plans``)."""

    max_n: int
    max_steps: int
    max_texts: int
    max_seq_len: int
    max_timeout_s: float = 60.0
    defaults: str = ""

    def ranges(self) -> dict[str, Range]:
        """Each bounded body field's range, from the one table."""
        return body_ranges(self.max_n, self.max_steps, self.max_texts, self.max_seq_len, self.max_timeout_s)


def request_models(limits: BodyLimits) -> RequestModels:
    """The /v1 bodies with this server's limits."""
    return RequestModels(generate_body_model(limits), texts_body_model(limits), limits.ranges())


class GenerateFields(SamplingBody):
    """/v1/generate's body, as the handler reads it."""

    def to_request(self) -> GenerateRequest:
        """The request for ``n`` samples of ``length`` tokens, a prompt's included (serve/api/prompted.py)."""
        fields: Any = self
        return self.sampling_request(fields.n, fields.length, fields.seed)


def generate_body_model(limits: BodyLimits) -> type[BaseModel]:
    """The /v1/generate body: its bounds from ``limits``; what it leaves out, ``ldlm.sampling.resolve`` fills in."""
    r = limits.ranges()
    return create_model(
        "GenerateBody",
        __base__=GenerateFields,
        n=(int, ranged(r["n"], 1, f"samples to generate ({r['n']})")),
        length=(int, ranged(r["length"], 64, f"tokens per sample, a prompt's included ({r['length']}, the model's max_seq_len)")),
        seed=(int | None, ranged(r["seed"], None, f"noise seed ({r['seed']}; default: 0)")),
        **sampling_fields(limits),
        stream=(
            bool,
            Field(
                False,
                strict=True,
                description="answer with Server-Sent Events: `preview` events (each sample's current "
                "x0_hat decoded) every `preview_every` steps, then one `result` event",
            ),
        ),
        preview_every=(int, ranged(r["preview_every"], 5, f"steps between previews when streaming ({r['preview_every']})")),
        prompt=(str, Field("", description="text to continue (prefix inpainting); the answer and previews are of what follows it")),
        timeout_s=(float | None, timeout_field(limits)),
    )


def texts_body_model(limits: BodyLimits) -> type[BaseModel]:
    """The /v1/encode and /v1/reconstruct body: 1..max_texts non-empty texts."""
    texts = limits.ranges()["texts"]
    return create_model(
        "TextsBody",
        __config__=STRICT_BODY,
        texts=(
            list[Annotated[str, AfterValidator(non_empty)]],
            Field(
                ...,
                min_length=int(texts.low),
                max_length=int(texts.high),
                description=f"{texts} non-empty texts, each at most {limits.max_seq_len} GPT-2 tokens",
            ),
        ),
    )


def field_name(loc: tuple[Any, ...] | list[Any]) -> str:
    """pydantic's ('body', 'texts', 0) -> 'texts[0]', as the request names it."""
    name = ""
    for part in loc:
        if part == "body" and not name:
            continue
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or "body"


def shown(value: Any) -> str:
    """A value as the client wrote it (JSON): true, 1e+30, "abc"."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


RANGE_ERRORS = ("less_than_equal", "greater_than_equal", "less_than", "greater_than", "too_long", "too_short")


UNKNOWN_FIELDS_SHOWN = 10  # a body of 200k unknown keys is answered with a short error, not a 2 MB one


def validation_message(
    errors: list[dict[str, Any]], limits: dict[str, Range], fields: Sequence[str] = (), content_type: str | None = None
) -> str:
    """pydantic errors -> one readable line per problem, naming the field, the value and what is allowed.
    ``content_type``: the request's, named when a body that is not a JSON object came without JSON's."""
    problems = []
    unknown = [field_name(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        known = f"; allowed: {', '.join(fields)}" if fields else ""
        shown_names = ", ".join(repr(u) for u in unknown[:UNKNOWN_FIELDS_SHOWN])
        more = f" and {len(unknown) - UNKNOWN_FIELDS_SHOWN} more" if len(unknown) > UNKNOWN_FIELDS_SHOWN else ""
        problems.append(f"unknown field{'s' if len(unknown) > 1 else ''} {shown_names}{more}{known}")
    for e in errors:
        name, kind, given = field_name(e["loc"]), e["type"], e.get("input")
        allowed = limits.get(name)
        if kind == "extra_forbidden":
            continue
        if kind in ("dict_type", "model_attributes_type") and tuple(e["loc"]) == ("body",):
            sent = (content_type or "").split(";")[0].strip().lower()
            hint = (
                "" if sent == "application/json" else f" (it was sent as {sent or 'no Content-Type'}: send Content-Type: application/json)"
            )
            problems.append(
                f"the body is not a JSON object{hint}; allowed: a JSON object of {', '.join(fields) or 'the documented fields'}"
            )
        elif kind == "json_invalid":
            problems.append(f"the body is not valid JSON ({e.get('ctx', {}).get('error', 'parse error')} at character {e['loc'][-1]})")
        elif kind == "missing":
            problems.append(f"{name} is required")
        elif allowed is not None and kind in RANGE_ERRORS:
            value = f"{len(given)}{allowed.unit}" if isinstance(given, list) else shown(given)
            problems.append(f"{name}: {value} is out of range; allowed: {allowed}")
        elif kind in ("int_type", "int_parsing", "int_from_float"):
            what = "a boolean" if isinstance(given, bool) else "not an integer"
            problems.append(f"{name}: {shown(given)} is {what}; allowed: an integer" + (f" in {allowed}" if allowed else ""))
        elif kind in ("float_type", "float_parsing"):
            problems.append(f"{name}: {shown(given)} is not a number; allowed: " + (str(allowed) if allowed else "a number"))
        elif kind in ("bool_type", "bool_parsing"):
            problems.append(f"{name}: {shown(given)} is not a boolean; allowed: true or false")
        elif kind == "string_too_short" and given == "":
            problems.append(f'{name}: "" is empty; allowed: a non-empty text')
        elif kind == "string_type":
            problems.append(f"{name}: {shown(given)} is not a text; allowed: a JSON string")
        elif kind == "literal_error":
            problems.append(f"{name}: {shown(given)} is unknown; allowed: {e.get('ctx', {}).get('expected', '')}")
        else:
            problems.append(f"{name}: {shown(given)}: {e['msg']}" if "input" in e else f"{name}: {e['msg']}")
    return "; ".join(problems)
