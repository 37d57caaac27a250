"""Loose input is refused, not guessed at: unknown fields, booleans or floats for integers, empty
texts, and OpenAI parameters this model cannot honour each get an error naming the field, the value
given and what is allowed. Expected messages are written out by hand; real server on 127.0.0.1,
httpx and the official openai client."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")
openai = pytest.importorskip("openai", reason="the OpenAI client under test (pip install -e .[test])")

from ldlm.model.config import SAMPLERS  # noqa: E402
from ldlm.pipeline import LDLMPipeline  # noqa: E402
from ldlm.serve.api.schemas import BodyLimits, request_models  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from tests.servers import RunningServer, free_port, openai_client  # noqa: E402

GENERATE_FIELDS = (
    "n, length, seed, steps, sampler, t_min, grid, prior_temperature, prompt_strength, stream, preview_every, prompt, timeout_s"
)


@pytest.fixture(scope="module")
def server(export_dir: Path):
    settings = ServerSettings(port=free_port(), max_batch=8, request_timeout_s=60, max_n=4, max_steps=100, max_texts=2)
    running = RunningServer(LDLMService(str(export_dir), settings))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer):
    with openai_client(server) as client:
        yield client


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/generate", {"n": True}, "n: true is a boolean; allowed: an integer in 1..4"),  # ran as n=1 before
        ("/v1/generate", {"n": 2.0}, "n: 2.0 is not an integer; allowed: an integer in 1..4"),
        ("/v1/generate", {"steps": "10"}, 'steps: "10" is not an integer; allowed: an integer in 1..100'),
        ("/v1/generate", {"seed": 1e30}, "seed: 1e+30 is not an integer; allowed: an integer in 0..9223372036854775807"),
        ("/v1/generate", {"seed": 2**63}, "seed: 9223372036854775808 is out of range; allowed: 0..9223372036854775807"),
        ("/v1/generate", {"t_min": 5}, "t_min: 5 is out of range; allowed: a number in (0, 1), both ends excluded"),
        ("/v1/generate", {"t_min": 0}, "t_min: 0 is out of range; allowed: a number in (0, 1), both ends excluded"),
        ("/v1/generate", {"prior_temperature": 1.5}, "prior_temperature: 1.5 is out of range; allowed: a number in (0, 1]"),
        ("/v1/generate", {"prior_temperature": 0}, "prior_temperature: 0 is out of range; allowed: a number in (0, 1]"),
        ("/v1/generate", {"prompt_strength": 4.5}, "prompt_strength: 4.5 is out of range; allowed: a number in [0, 4]"),
        ("/v1/generate", {"prompt_strength": -1}, "prompt_strength: -1 is out of range; allowed: a number in [0, 4]"),
        ("/v1/generate", {"stream": 1}, "stream: 1 is not a boolean; allowed: true or false"),
        (
            "/v1/generate",
            {"sampler": "euler"},
            'sampler: "euler" is unknown; allowed: '  # every name in ldlm.model.config.SAMPLERS
            + ", ".join(repr(name) for name in SAMPLERS[:-1])
            + f" or {SAMPLERS[-1]!r}",
        ),
        ("/v1/generate", {"temprature": 0.5}, f"unknown field 'temprature'; allowed: {GENERATE_FIELDS}"),
        ("/v1/generate", {"n": 1, "lenght": 8, "step": 2}, f"unknown fields 'lenght', 'step'; allowed: {GENERATE_FIELDS}"),
        ("/v1/reconstruct", {"texts": [""]}, 'texts[0]: "" is empty; allowed: a non-empty text'),  # was a 400, [] a 422
        ("/v1/encode", {"texts": ["ok", ""]}, 'texts[1]: "" is empty; allowed: a non-empty text'),
        ("/v1/encode", {"texts": []}, "texts: 0 items is out of range; allowed: 1..2"),
        ("/v1/encode", {"texts": [7]}, "texts[0]: 7 is not a text; allowed: a JSON string"),
        ("/v1/encode", {"texts": ["a"], "normalize": True}, "unknown field 'normalize'; allowed: texts"),
    ],
)
def test_loose_text_api_input_is_refused_naming_it(server: RunningServer, path: str, body: dict, message: str) -> None:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert response.status_code == 422, response.text
    assert response.json() == {"error": message}


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"temperature": 2.5}, "temperature", None),  # temperature, top_p and logprobs act at the token decoder:
        ({"logprobs": 6}, "logprobs", None),  # out of their ranges they are refused (tests/serve/api/routes/test_openai.py)
        (
            {"best_of": 3},
            "best_of",
            "best_of=3 is not supported by this diffusion model (completions are not scored; ask for n "
            "choices instead); allowed: 1 or null",
        ),
        ({"top_p": 0}, "top_p", None),
        ({"presence_penalty": 1.0}, "presence_penalty", None),
        ({"frequency_penalty": -1.0}, "frequency_penalty", None),
        ({"logit_bias": {"50256": -100}}, "logit_bias", None),
        ({"suffix": " end"}, "suffix", None),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "stop has 5 items; allowed: 1..4 non-empty texts"),
        (
            {"extra_body": {"temprature": 1}},
            "temprature",
            "unknown field 'temprature'; allowed: model, prompt, max_tokens, min_tokens, n, seed, "
            "stream, stream_options, stop, echo, user, ignore_eos, steps, sampler, t_min, grid, prior_temperature, prompt_strength, timeout_s, temperature, "
            "top_p, best_of, logprobs, frequency_penalty, presence_penalty, logit_bias, suffix",
        ),
        (
            {"extra_body": {"prior_temperature": 2}},
            "prior_temperature",
            "prior_temperature: 2 is out of range; allowed: a number in (0, 1]",
        ),
        ({"extra_body": {"prompt_strength": 5}}, "prompt_strength", "prompt_strength: 5 is out of range; allowed: a number in [0, 4]"),
        ({"n": True}, "n", "n: true is a boolean; allowed: an integer in 1..4"),
        ({"extra_body": {"seed": 1e30}}, "seed", "seed: 1e+30 is not an integer; allowed: an integer in 0..9223372036854775807"),
    ],
)
def test_unsupported_openai_parameters_are_refused_naming_them(client, kwargs: dict, param: str, message: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="ldlm", prompt="", max_tokens=4, **kwargs)
    error = raised.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"] == message if message is not None else error["message"].startswith((f"{param}=", f"{param}: ")), error


def test_openai_defaults_that_ask_for_nothing_are_accepted(client) -> None:
    """What a client that sets the other parameters to OpenAI's defaults (and temperature 0, this server's
    argmax default) sends: the same completion as without them."""
    plain = client.completions.create(model="ldlm", prompt="", max_tokens=6, seed=4, extra_body={"steps": 3, "sampler": "ddim"})
    same = client.completions.create(
        model="ldlm",
        prompt="",
        max_tokens=6,
        seed=4,
        temperature=0,
        top_p=1,
        best_of=1,
        logprobs=None,
        presence_penalty=0,
        frequency_penalty=0,
        user="someone",
        echo=False,
        extra_body={"steps": 3, "sampler": "ddim"},
    )
    assert [c.text for c in same.choices] == [c.text for c in plain.choices]


def test_stop_cuts_the_completion_before_the_stop_text(client, pipeline: LDLMPipeline) -> None:
    args = {"model": "ldlm", "prompt": "", "max_tokens": 24, "seed": 9, "extra_body": {"steps": 3, "sampler": "ddim"}}
    full = client.completions.create(**args).choices[0]
    assert len(full.text) > 8, full.text
    stop = full.text[5:8]  # a text the completion holds, cut by hand below
    expected = full.text[: full.text.find(stop)]
    stopped = client.completions.create(**args, stop=[stop, "\u2603 never there"])
    choice = stopped.choices[0]
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    assert stopped.usage.completion_tokens == (len(pipeline.tokenizer.encode([expected])[0]) if expected else 0)
    assert client.completions.create(**args, stop="\u2603 never there").choices[0].text == full.text


def test_stop_may_leave_a_blank_completion(client, tiny_checkpoint: Path) -> None:
    """A stop text right after the completion's leading spaces leaves them alone (or nothing): still a
    valid answer (it was a 400 while the cut text was re-encoded as a model input), its tokens counted
    by the tokenizers library itself."""
    # the first seed whose completion starts with spaces (GPT-2's tokens mostly carry a leading space)
    for seed in range(20):
        args = {"model": "ldlm", "prompt": "", "max_tokens": 24, "seed": seed, "extra_body": {"steps": 3, "sampler": "ddim"}}
        full = client.completions.create(**args).choices[0].text
        words = full.lstrip()
        blank = full[: len(full) - len(words)]
        if blank and len(words) >= 3:
            break
    assert blank and len(words) >= 3, f"no completion of 20 starts with spaces: the case is not exercised ({full!r})"
    stopped = client.completions.create(**args, stop=words[:3])
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (blank, "stop")
    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    assert stopped.usage.completion_tokens == len(tokenizer.encode(blank).ids)


def test_echo_puts_the_prompt_before_the_completion(client) -> None:
    args = {"model": "ldlm", "prompt": ["Once upon", "The end"], "max_tokens": 5, "seed": 2, "extra_body": {"steps": 3, "sampler": "ddim"}}
    plain = client.completions.create(**args)
    echoed = client.completions.create(**args, echo=True)
    assert [c.text for c in echoed.choices] == ["Once upon" + plain.choices[0].text, "The end" + plain.choices[1].text]


def test_the_plan_fields_default_to_not_given() -> None:
    """A body fills in none of the plan's fields: the request it makes leaves them to ldlm.sampling.resolve,
    and /docs shows what that gives (the service's words, passed in as ``defaults``)."""
    models = request_models(BodyLimits(4, 100, 2, 128, defaults="dpm3m-psc at 12 steps on the tuned grid"))
    request = models.generate.model_validate({}).to_request()
    assert (request.n, request.length) == (1, 64)
    fields = (request.steps, request.sampler, request.seed, request.t_min, request.grid, request.prior_temperature, request.prompt_strength)
    assert fields == (None,) * 7
    steps = models.generate.model_json_schema()["properties"]["steps"]
    assert steps["default"] is None and "dpm3m-psc at 12 steps on the tuned grid" in steps["description"]
