"""The text API's request and response schemas, and the one error shape of every route.

Request limits depend on the server (``ServerSettings.max_n``, ``max_steps``, ``max_texts``) and
on the model (``max_seq_len``), so the request models are built per app by ``request_models``:
the bounds are then both enforced and visible in ``/openapi.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, create_model


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx of every route: one message naming the bad value and the allowed range."""

    error: str = Field(..., description="what was wrong, the value given and what is allowed")


class TextsResponse(BaseModel):
    texts: list[str] = Field(..., description="one decoded text per sample")
    token_ids: list[list[int]] = Field(..., description="the decoded GPT-2 token ids, one list per sample, without padded positions")


class EncodeResponse(BaseModel):
    shape: list[int] = Field(..., description="(B, L, D): texts, tokens of the longest text, latent width")
    latents: list[list[list[float]]] = Field(..., description="standardized latents, right-padded to L")
    attention_mask: list[list[int]] = Field(..., description="1 for a real token, 0 for padding")


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in {400: "malformed request", 401: "missing or wrong bearer token", 408: "body too slow",
                       413: "body or request too large", 422: "a field out of range",
                       503: "queue full (Retry-After)", 504: "timed out"}.items()
}


@dataclass(frozen=True)
class RequestModels:
    generate: type[BaseModel]
    texts: type[BaseModel]
    limits: dict[str, tuple[int, int]]  # field -> (low, high), for messages


def request_models(max_n: int, max_steps: int, max_texts: int, max_seq_len: int) -> RequestModels:
    generate = create_model(
        "GenerateBody",
        n=(int, Field(1, ge=1, le=max_n, description=f"samples to generate (1..{max_n})")),
        length=(int, Field(64, ge=1, le=max_seq_len, description=f"tokens per sample (1..{max_seq_len}, the model's max_seq_len)")),
        steps=(int, Field(50, ge=1, le=max_steps, description=f"denoising steps (1..{max_steps})")),
        seed=(int, Field(0, ge=0, lt=2**63, description="noise seed")),
        sampler=(Literal["sde", "ddim"], Field("sde", description="sde: Euler-Maruyama; ddim: deterministic")),
        t_min=(float | None, Field(None, gt=0, lt=1, description="last time of the grid")),
        stream=(bool, Field(False, description="answer with Server-Sent Events: `preview` events (each sample's current "
                                               "x0_hat decoded) every `preview_every` steps, then one `result` event")),
        preview_every=(int, Field(5, ge=1, le=max_steps, description="steps between previews when streaming")),
    )
    texts = create_model(
        "TextsBody",
        texts=(list[str], Field(..., min_length=1, max_length=max_texts,
                                description=f"1..{max_texts} non-empty texts, each at most {max_seq_len} GPT-2 tokens")),
    )
    limits = {"n": (1, max_n), "length": (1, max_seq_len), "steps": (1, max_steps), "seed": (0, 2**63 - 1), "texts": (1, max_texts),
              "preview_every": (1, max_steps)}
    return RequestModels(generate, texts, limits)


def field_name(loc: tuple[Any, ...] | list[Any]) -> str:
    """pydantic's ('body', 'texts', 0) -> 'texts[0]', as the request names it."""
    name = ""
    for part in loc:
        if part == "body" and not name:
            continue
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or "body"


def validation_message(errors: list[dict[str, Any]], limits: dict[str, tuple[int, int]]) -> str:
    """pydantic errors -> one readable line per problem, naming the field, the value and the range."""
    problems = []
    for e in errors:
        name = field_name(e["loc"])
        if e["type"] == "json_invalid":
            problems.append(f"the body is not valid JSON ({e.get('ctx', {}).get('error', 'parse error')} at character {e['loc'][-1]})")
        elif name in limits and e["type"] in ("less_than_equal", "greater_than_equal", "too_long", "too_short"):
            low, high = limits[name]
            given = len(e["input"]) if isinstance(e["input"], list) else e["input"]
            unit = " items" if isinstance(e["input"], list) else ""
            problems.append(f"{name}: {given}{unit} is out of range; allowed: {low}..{high}")
        else:
            problems.append(f"{name}: {e['msg']}")
    return "; ".join(problems)
