"""ldlm.limits is the one table of bounds: its Range against an independent reading of an interval, and every
server setting and request-body field bounded exactly as the table says (the body models' JSON schema, which
is what pydantic enforces and /openapi.json shows)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from ldlm.limits import PRIOR_TEMPERATURE, SETTINGS, T_MIN, Range, body_ranges, out_of_range, sequence_lengths

pytest.importorskip("fastapi", reason="the body models are the service's (pip install -e .)")

from ldlm.serve.api.openai_schemas import completion_body  # noqa: E402
from ldlm.serve.api.schemas import BodyLimits, request_models  # noqa: E402
from ldlm.serve.api.service import ServerSettings  # noqa: E402

LIMITS = BodyLimits(max_n=5, max_steps=77, max_texts=3, max_seq_len=96, max_timeout_s=42.0)


def inside(value: float, low: float, high: float, low_open: bool, high_open: bool) -> bool:
    """The interval, read independently of Range: a number above low (or at it, when closed) and below high."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return False
    return (low < value if low_open else low <= value) and (value < high if high_open else value <= high)


@pytest.mark.parametrize("low_open", [False, True])
@pytest.mark.parametrize("high_open", [False, True])
def test_a_range_holds_what_its_interval_holds(low_open: bool, high_open: bool) -> None:
    r = Range(0, 1, low_open, high_open, number=True)
    for value in (-1, 0, 0.0, 1e-12, 0.5, 1, 1.0, 1 + 1e-12, math.nan, math.inf, -math.inf, True, "0.5", None):
        assert (value in r) == inside(value, 0, 1, low_open, high_open), value  # type: ignore[arg-type]


def test_a_range_names_itself_as_refusals_do() -> None:
    assert str(Range(1, 64)) == "1..64"
    assert str(T_MIN) == "a number in (0, 1), both ends excluded"
    assert str(PRIOR_TEMPERATURE) == "a number in (0, 1]"
    with pytest.raises(ValueError, match=r"^t_min=1\.0 is out of range; allowed: a number in \(0, 1\), both ends excluded$"):
        T_MIN.check("t_min", 1.0)


def test_a_refusal_names_the_value_both_ends_and_why() -> None:
    """The one sentence every front end refuses with: the CLI's option values, the bodies' fields, the settings."""
    assert Range(1, 64).refusal("--n 0", " samples") == "--n 0 is out of range; allowed: 1..64 samples"
    assert sequence_lengths(128).refusal("--length 129") == "--length 129 is out of range; allowed: 1..128"
    assert out_of_range("x=3", "a number in [0, 2]") == "x=3 is out of range; allowed: a number in [0, 2]"
    with pytest.raises(ValueError, match=r"^n=0 is out of range; allowed: 1\.\.64$"):
        Range(1, 64).check("n", 0)


def bounds_in_schema(schema: dict) -> dict[str, float]:
    """A field's bounds as its JSON schema states them (a nullable field: its non-null branch)."""
    branch = next((b for b in schema.get("anyOf", []) if b.get("type") != "null"), schema)
    keys = {"minimum": "ge", "maximum": "le", "exclusiveMinimum": "gt", "exclusiveMaximum": "lt", "minItems": "ge", "maxItems": "le"}
    return {keys[k]: v for k, v in branch.items() if k in keys}


BODIES = {
    "generate": lambda: request_models(LIMITS).generate,
    "texts": lambda: request_models(LIMITS).texts,
    "completions": lambda: completion_body(LIMITS),
}


@pytest.mark.parametrize("body", list(BODIES))
def test_every_bounded_body_field_is_bounded_by_the_table(body: str) -> None:
    table = body_ranges(LIMITS.max_n, LIMITS.max_steps, LIMITS.max_texts, LIMITS.max_seq_len, LIMITS.max_timeout_s)
    properties = BODIES[body]().model_json_schema()["properties"]
    bounded = {name: bounds_in_schema(schema) for name, schema in properties.items() if bounds_in_schema(schema)}
    assert bounded, "no bounded field found: the schema reader is broken"
    for name, found in bounded.items():
        assert name in table, f"{body}.{name} is bounded ({found}) by no entry of ldlm.limits.body_ranges"
        assert found == table[name].field_bounds(), f"{body}.{name}: schema {found}, table {table[name]}"
    numeric = {n for n, s in properties.items() if {"integer", "number"} & {b.get("type") for b in [s, *s.get("anyOf", [])]}}
    assert numeric <= set(bounded) | {"stream"}, f"unbounded numeric fields: {numeric - set(bounded)}"


def test_every_numeric_server_setting_has_a_range_in_the_table() -> None:
    numeric = {f.name for f in dataclasses.fields(ServerSettings) if any(t in str(f.type) for t in ("int", "float"))}
    assert numeric <= set(SETTINGS), f"settings without a range: {numeric - set(SETTINGS)}"
