"""/v1/completions as the common tools call it at their defaults, against the real server on 127.0.0.1
(with an API key): null in every optional field is its default, through the official ``openai`` client
(which sends null for an argument given as None) and raw JSON; vLLM's ``ignore_eos``, ``min_tokens`` and
``stream_options.continuous_usage_stats`` with their meaning for a sampler that writes every position at
once; ``stream_options`` without a stream refused as vLLM refuses it; an unknown field still refused;
/version open without the key, as /health. Where a completion must hold end-of-text tokens at known
places, the scheduler's answer is written by hand (GPT-2's ids, written out)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")
openai = pytest.importorskip("openai", reason="the OpenAI client under test (pip install -e .[test])")

from ldlm.pipeline import TextResult  # noqa: E402
from ldlm.serve.api.openai_schemas import completion_body  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from scripts.harness.traffic import sse_events  # noqa: E402
from tests.servers import RunningServer, free_port  # noqa: E402

KEY = "t0ken"
AUTH = {"Authorization": f"Bearer {KEY}"}
# GPT-2's BPE: "Hello" 15496, " world" 995, "I" 40, " was" 373, " a" 257; <|endoftext|> 50256
HELLO, WORLD, WORD_I, WAS, A, EOS = 15496, 995, 40, 373, 257, 50256
PLAN = {"steps": 3, "sampler": "ddim"}
BASE = {"prompt": "Once", "max_tokens": 5, "seed": 3, **PLAN}  # each null test leaves its own field out of this

# Every optional field of the completions body: OpenAI's, which the client takes as arguments, and vLLM's
# and LDLM's, which it sends in extra_body. ``test_these_are_every_optional_field`` holds the list to the schema.
CLIENT_FIELDS = (
    "prompt",
    "max_tokens",
    "n",
    "seed",
    "stream",
    "stream_options",
    "stop",
    "echo",
    "user",
    "temperature",
    "top_p",
    "best_of",
    "logprobs",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "suffix",
)
EXTRA_FIELDS = ("ignore_eos", "min_tokens", "steps", "sampler", "t_min", "grid", "prior_temperature", "prompt_strength", "timeout_s")


@pytest.fixture(scope="module")
def server(export_dir: Path) -> Iterator[RunningServer]:
    settings = ServerSettings(port=free_port(), max_batch=8, request_timeout_s=60, max_n=8, max_steps=50, api_key=KEY)
    running = RunningServer(LDLMService(str(export_dir), settings))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def sent() -> list[dict[str, Any]]:
    """The bodies the client sent, newest last."""
    return []


@pytest.fixture(scope="module")
def client(server: RunningServer, sent: list[dict[str, Any]]) -> Iterator[Any]:
    def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    http = httpx.Client(event_hooks={"request": [record]}, timeout=60)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, http_client=http) as client:
        yield client


def post(server: RunningServer, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"model": "ldlm", **body}, headers=AUTH, timeout=60)


def answered(answer: dict[str, Any]) -> tuple[Any, ...]:
    """What a completion says, without its id and time."""
    return [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]], answer["usage"], answer.get("ldlm_plan")


def refusal(answer: httpx.Response) -> tuple[int, str, str | None]:
    error = answer.json()["error"]
    return answer.status_code, error["message"], error["param"]


# --- null is the default ----------------------------------------------------------------------------------


def test_these_are_every_optional_field(server: RunningServer) -> None:
    schema = httpx.get(f"{server.url}/openapi.json", timeout=10).json()["components"]["schemas"]["CompletionBody"]
    assert set(schema["properties"]) - set(schema["required"]) == {*CLIENT_FIELDS, *EXTRA_FIELDS}
    assert schema["required"] == ["model"]


@pytest.mark.parametrize("field", CLIENT_FIELDS + EXTRA_FIELDS)
def test_null_through_the_openai_client_is_the_default(server: RunningServer, client: Any, sent: list, field: str) -> None:
    """The client sends ``field: null`` for an argument given as None; the answer is the one without the field."""
    body = {k: v for k, v in BASE.items() if k != field}
    extra = {k: body.pop(k) for k in EXTRA_FIELDS if k in body}
    args, extra = ({field: None}, extra) if field in CLIENT_FIELDS else ({}, {**extra, field: None})
    if field != "prompt":
        args["prompt"] = body.pop("prompt")
    got = client.completions.create(model="ldlm", **body, **args, extra_body=extra)
    assert field in sent[-1] and sent[-1][field] is None  # the client did send null
    left_out = post(server, **{k: v for k, v in BASE.items() if k != field})
    assert left_out.status_code == 200
    assert answered(got.model_dump(exclude_none=True)) == answered(left_out.json())


def test_max_tokens_echo_and_stream_null_together_are_the_defaults(server: RunningServer, client: Any, sent: list) -> None:
    """OpenAI's client given None for all three: a whole (not streamed) answer of 16 tokens, without the prompt."""
    got = client.completions.create(model="ldlm", prompt="Once", seed=3, max_tokens=None, echo=None, stream=None, extra_body=PLAN)
    assert {k: sent[-1][k] for k in ("max_tokens", "echo", "stream")} == {"max_tokens": None, "echo": None, "stream": None}
    explicit = post(server, prompt="Once", seed=3, max_tokens=16, echo=False, stream=False, **PLAN).json()
    assert answered(got.model_dump(exclude_none=True)) == answered(explicit)


def test_null_parses_as_each_fields_own_default(server: RunningServer) -> None:
    """Not only an answer alike: the body the handler reads holds the field's default, as if the field were
    left out, never a None that code testing ``is False`` would misread."""
    body = completion_body(server.service.body_limits())
    for field in CLIENT_FIELDS + EXTRA_FIELDS:
        parsed = body.model_validate({"model": "ldlm", field: None})
        assert getattr(parsed, field) == body.model_fields[field].default and field not in parsed.model_fields_set, field
    for field in ("include_usage", "continuous_usage_stats"):
        options = body.model_validate({"model": "ldlm", "stream": True, "stream_options": {field: None}}).stream_options
        assert getattr(options, field) is False and field not in options.model_fields_set, field


@pytest.mark.parametrize("field", ["include_usage", "continuous_usage_stats"])
def test_null_in_stream_options_is_the_default(server: RunningServer, field: str) -> None:
    def events(options: dict[str, Any]) -> list[Any]:
        body = {"model": "ldlm", **BASE, "stream": True, "stream_options": options}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
            assert response.status_code == 200
            return [
                {k: v for k, v in e.items() if k not in ("id", "created")} if isinstance(e, dict) else e
                for _, e in sse_events(response.iter_lines())
            ]

    assert events({field: None}) == events({})


def test_a_required_field_null_and_an_unknown_field_are_still_refused(server: RunningServer) -> None:
    status, message, param = refusal(post(server, **BASE, model=None))
    assert (status, param) == (400, "model") and message.startswith("model: ")
    for unknown, value in (("ignore_eoss", True), ("best_of_n", None)):  # null does not let an unknown field through
        status, message, _ = refusal(post(server, **BASE, **{unknown: value}))
        assert status == 400 and message.startswith(f"unknown field {unknown!r}; allowed: model, prompt, max_tokens")


# --- ignore_eos and min_tokens: where a completion ends -------------------------------------------------------


@pytest.fixture
def written(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The scheduler answers prompt k of each request with row k of this list (its n choices alike), as set by the test."""
    rows: list[list[int]] = []
    calls = itertools.count()

    def submit(spec: Any, *args: Any, **kwargs: Any) -> Future[TextResult]:
        ids = rows[next(calls) % len(rows)]
        assert spec.length == len(ids)  # a prompt of "" and max_tokens = the row's length
        future: Future[TextResult] = Future()
        future.set_result(TextResult(torch.tensor([ids] * spec.n), [], [len(ids)] * spec.n))
        return future

    monkeypatch.setattr(server.service.scheduler, "submit", submit)
    return rows


def one_choice(server: RunningServer, ids: list[int], written: list[list[int]], **body: Any) -> tuple[str, str, int]:
    written[:] = [ids]
    answer = post(server, prompt="", max_tokens=len(ids), **body)
    assert answer.status_code == 200, answer.text
    (choice,), used = answer.json()["choices"], answer.json()["usage"]
    return choice["text"], choice["finish_reason"], used["completion_tokens"]


EARLY_EOS = [HELLO, WORLD, EOS, WORD_I, WAS, A]
TWO_EOS = [HELLO, EOS, WORLD, EOS, WORD_I, A]


def test_ignore_eos_true_runs_past_end_of_text_and_false_is_the_default(server: RunningServer, written: list) -> None:
    assert one_choice(server, EARLY_EOS, written) == ("Hello world", "stop", 2)
    assert one_choice(server, EARLY_EOS, written, ignore_eos=False) == ("Hello world", "stop", 2)
    # every position was sampled: with ignore_eos the choice is all max_tokens of them, the end-of-text token
    # counted but not shown, as vLLM skips special tokens in its text
    assert one_choice(server, EARLY_EOS, written, ignore_eos=True) == ("Hello worldI was a", "length", 6)
    assert one_choice(server, EARLY_EOS, written, ignore_eos=True, stop=" was") == ("Hello worldI", "stop", 3)


@pytest.mark.parametrize(
    ("ids", "min_tokens", "expected"),
    [
        (EARLY_EOS, 0, ("Hello world", "stop", 2)),
        (EARLY_EOS, 2, ("Hello world", "stop", 2)),  # the end-of-text token is the third: min_tokens 2 lets it end the choice
        (EARLY_EOS, 3, ("Hello worldI was a", "length", 6)),  # within the first 3: it ends nothing, and no later one comes
        (TWO_EOS, 2, ("Hello world", "stop", 3)),  # the first within the first 2, the next ends it
        (TWO_EOS, 6, ("Hello worldI a", "length", 6)),  # min_tokens = max_tokens: no end-of-text ends it
    ],
)
def test_min_tokens_keeps_an_early_end_of_text_from_ending_the_choice(
    server: RunningServer, written: list, ids: list[int], min_tokens: int, expected: tuple
) -> None:
    assert one_choice(server, ids, written, min_tokens=min_tokens) == expected


@pytest.mark.parametrize(
    ("min_tokens", "allowed"),
    [
        (7, "min_tokens=7 is out of range; allowed: 0..6 (max_tokens, the tokens each choice has)"),
        (100, "min_tokens=100 is out of range; allowed: 0..6 (max_tokens, the tokens each choice has)"),
        (-1, "min_tokens: -1 is out of range; allowed: 0..128"),  # the schema's bound, as every bounded field's
        (129, "min_tokens: 129 is out of range; allowed: 0..128"),  # past the model's max_seq_len, whatever max_tokens
    ],
)
def test_min_tokens_out_of_range_is_refused_naming_it_and_max_tokens(server: RunningServer, min_tokens: int, allowed: str) -> None:
    assert refusal(post(server, prompt="", max_tokens=6, min_tokens=min_tokens)) == (400, allowed, "min_tokens")


def test_min_tokens_at_max_tokens_is_taken_with_the_default_max_tokens(server: RunningServer) -> None:
    """max_tokens left out is 16: min_tokens 16 is taken, 17 refused naming 16."""
    assert post(server, prompt="", min_tokens=16, seed=1, **PLAN).status_code == 200
    assert refusal(post(server, prompt="", min_tokens=17, **PLAN))[1].endswith("allowed: 0..16 (max_tokens, the tokens each choice has)")


# --- streams: continuous_usage_stats, stream_options without a stream -------------------------------------------


def streamed(server: RunningServer, **body: Any) -> list[Any]:
    with httpx.stream("POST", f"{server.url}/v1/completions", json={"model": "ldlm", **body}, headers=AUTH, timeout=60) as response:
        assert response.status_code == 200
        return [e for _, e in sse_events(response.iter_lines())]


@pytest.mark.parametrize("include_usage", [True, False])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(server: RunningServer, written: list, include_usage: bool) -> None:
    """Three prompts of 2 choices, each with its own length: every chunk's usage counts all the prompt tokens
    (none here) and the completion tokens of the chunks sent until then, its own included."""
    written[:] = [[HELLO, WORLD, EOS, A], [HELLO, EOS, A, A], [WORD_I, WAS, A, WORLD]]  # 2, 1, 4 tokens per choice
    per_prompt = {0: 2, 1: 1, 2: 4}
    options = {"include_usage": include_usage, "continuous_usage_stats": True}
    events = streamed(server, prompt=["", "", ""], max_tokens=4, n=2, stream=True, stream_options=options)
    chunks, last = events[:3], events[3:]
    so_far = 0
    for chunk in chunks:
        so_far += sum(per_prompt[c["index"] // 2] for c in chunk["choices"])
        assert chunk["usage"] == {"prompt_tokens": 0, "completion_tokens": so_far, "total_tokens": so_far}
    assert so_far == 14
    usage_chunk = [{**events[2], "choices": [], "usage": chunks[-1]["usage"]}] if include_usage else []
    assert last == [*usage_chunk, "[DONE]"]


def test_without_continuous_usage_stats_no_chunk_but_the_last_has_usage(server: RunningServer, written: list) -> None:
    written[:] = [[HELLO, WORLD, EOS, A], [WORD_I, WAS, A, WORLD]]
    events = streamed(server, prompt=["", ""], max_tokens=4, stream=True, stream_options={"include_usage": True})
    assert ["usage" in e for e in events[:-1]] == [False, False, True] and events[-1] == "[DONE]"
    assert events[2]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("stream", [None, False])
def test_stream_options_without_a_stream_are_refused_as_vllm_refuses_them(server: RunningServer, stream: bool | None) -> None:
    body = {**BASE, "stream_options": {"include_usage": True}, **({} if stream is None else {"stream": stream})}
    assert refusal(post(server, **body)) == (
        400,
        "Stream options can only be defined when `stream=True`; stream_options was given with stream=false",
        "stream_options",
    )


# --- the guard ------------------------------------------------------------------------------------------------


def test_version_is_open_without_the_key_and_v1_is_not(server: RunningServer) -> None:
    assert httpx.get(f"{server.url}/version", timeout=10).status_code == 200  # as vLLM's, which guards only /v1
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).status_code == 200
