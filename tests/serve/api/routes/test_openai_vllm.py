"""vLLM's additions to the OpenAI API (/health, /version, /v1/tokenize, /v1/detokenize, ``max_model_len`` in
/v1/models) against the real server on 127.0.0.1, checked against vLLM's documented shapes: tokenize
{"model"?, "prompt", "add_special_tokens"?, "return_token_strs"?} -> {"count", "max_model_len", "tokens",
"token_strs"}; detokenize {"model"?, "tokens"} -> {"prompt"}; version -> {"version"}; health -> 200, no body.
Token ids are GPT-2's, written out by hand."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")
openai = pytest.importorskip("openai", reason="the OpenAI client (pip install -e .[test])")

from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from tests.servers import RunningServer, free_port, openai_client  # noqa: E402

# GPT-2's BPE: "I" 40, " was" 373, " a" 257, spelled "I", "Ġwas", "Ġa" in its vocabulary; "Hello" 15496,
# " world" 995, <|endoftext|> 50256, the last of its 50257 tokens
I_WAS_A, HELLO, WORLD, EOS = [40, 373, 257], 15496, 995, 50256
MAX_SEQ_LEN = 128  # the tiny preset's


@pytest.fixture(scope="module")
def server(export_dir: Path):
    running = RunningServer(LDLMService(str(export_dir), ServerSettings(port=free_port(), max_steps=50)))
    yield running
    running.stop()


def post(server: RunningServer, path: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def refusal(answer: httpx.Response) -> str:
    """A refusal's message, from either of the server's error shapes: {"error": message} or OpenAI's {"error": {"message"}}."""
    error = answer.json()["error"]
    return error if isinstance(error, str) else error["message"]


def test_health_is_200_with_no_body_when_ready_and_503_when_not(server: RunningServer, monkeypatch) -> None:
    ready = httpx.get(f"{server.url}/health", timeout=10)
    assert (ready.status_code, ready.content) == (200, b"")
    monkeypatch.setattr(server.service, "ready", False)  # as while it drains at shutdown
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503


def test_version_is_the_installed_packages(server: RunningServer) -> None:
    answer = httpx.get(f"{server.url}/version", timeout=10)
    assert answer.status_code == 200 and answer.json() == {"version": importlib.metadata.version("ldlm")}


def test_models_name_their_max_model_len(server: RunningServer) -> None:
    with openai_client(server) as client:
        (model,) = client.models.list().data
    assert (model.id, model.model_extra["max_model_len"]) == ("ldlm", MAX_SEQ_LEN)


def test_tokenize_answers_vllms_shape_with_gpt2s_ids(server: RunningServer) -> None:
    expected = {"count": 3, "max_model_len": MAX_SEQ_LEN, "tokens": I_WAS_A, "token_strs": None}
    assert post(server, "/v1/tokenize", prompt="I was a").json() == expected
    assert post(server, "/v1/tokenize", model="ldlm", prompt="I was a", add_special_tokens=False).json() == expected  # GPT-2 adds none
    spelled = post(server, "/v1/tokenize", prompt="I was a", return_token_strs=True).json()
    assert spelled == {**expected, "token_strs": ["I", "Ġwas", "Ġa"]}
    assert post(server, "/v1/tokenize", prompt="").json() == {"count": 0, "max_model_len": MAX_SEQ_LEN, "tokens": [], "token_strs": None}


def test_detokenize_answers_vllms_shape_and_inverts_tokenize(server: RunningServer) -> None:
    assert post(server, "/v1/detokenize", tokens=I_WAS_A).json() == {"prompt": "I was a"}
    assert post(server, "/v1/detokenize", model="ldlm", tokens=[]).json() == {"prompt": ""}
    # an end-of-text token is spelled out, not where the text ends, so the text tokenizes back to the same ids
    text = post(server, "/v1/detokenize", tokens=[HELLO, EOS, WORLD]).json()["prompt"]
    assert text == "Hello<|endoftext|> world"
    assert post(server, "/v1/tokenize", prompt=text).json()["tokens"] == [HELLO, EOS, WORLD]


def test_tokenized_ids_complete_as_their_text(server: RunningServer) -> None:
    """/v1/tokenize's ids, sent back as the prompt, are the prompt /v1/completions read from the text."""
    plan = {"model": "ldlm", "max_tokens": 6, "n": 2, "seed": 5, "steps": 3, "sampler": "ddim"}
    ids = post(server, "/v1/tokenize", prompt="I was a").json()["tokens"]
    as_text, as_ids = (
        post(server, "/v1/completions", prompt="I was a", **plan).json(),
        post(server, "/v1/completions", prompt=ids, **plan).json(),
    )
    assert [c["text"] for c in as_ids["choices"]] == [c["text"] for c in as_text["choices"]]
    assert as_ids["usage"] == as_text["usage"]


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/detokenize", {"tokens": [40, 50257]}, 400, "tokens[1]=50257 is out of the vocabulary; allowed: token ids 0..50256"),
        ("/v1/detokenize", {"tokens": [-3]}, 400, "tokens[0]=-3 is out of the vocabulary; allowed: token ids 0..50256"),
        ("/v1/detokenize", {"model": "gpt-4", "tokens": [40]}, 404, "model 'gpt-4' does not exist; available: ldlm"),
        ("/v1/tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "model 'gpt-4' does not exist; available: ldlm"),
        ("/v1/tokenize", {"prompt": "   "}, 400, "prompt='   ' is blank; allowed: text with a non-space character, or \"\" for none"),
    ],
    ids=["past-the-vocabulary", "negative", "detokenize-unknown-model", "tokenize-unknown-model", "blank"],
)
def test_tokenize_and_detokenize_refuse_naming_what_is_allowed(
    server: RunningServer, path: str, body: dict, status: int, message: str
) -> None:
    answer = post(server, path, **body)
    assert (answer.status_code, refusal(answer)) == (status, message)


def test_tokenize_refuses_a_text_that_is_not_unicode(server: RunningServer) -> None:
    """A lone surrogate (JSON's "\\ud800", which clients' encoders will not send, hence the raw body) is no text: 400, not a 500."""
    raw = b'{"prompt": "a\\ud800"}'
    answer = httpx.post(f"{server.url}/v1/tokenize", content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert (answer.status_code, refusal(answer)) == (
        400,
        "prompt is not valid Unicode (surrogates not allowed at character 1); allowed: UTF-8 text",
    )


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/detokenize", {"tokens": [40, True]}, "tokens[1]"),
        ("/v1/detokenize", {"tokens": "I was a"}, "tokens"),
        ("/v1/tokenize", {"prompt": [40, 373]}, "prompt"),
        ("/v1/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ],
)
def test_tokenize_and_detokenize_refuse_a_wrong_type_naming_the_field(server: RunningServer, path: str, body: dict, field: str) -> None:
    answer = post(server, path, **body)
    assert 400 <= answer.status_code < 500 and refusal(answer).startswith(f"{field}: ")


def test_every_route_is_in_the_openapi_schema(server: RunningServer) -> None:
    schema = httpx.get(f"{server.url}/openapi.json", timeout=10).json()  # what /docs renders
    paths = schema["paths"]
    assert {"/health", "/version"} <= {p for p in paths if "get" in paths[p]}
    assert {"/v1/tokenize", "/v1/detokenize", "/v1/completions"} <= {p for p in paths if "post" in paths[p]}
    bodies = schema["components"]["schemas"]
    assert set(bodies["TokenizeBody"]["properties"]) == {"model", "prompt", "add_special_tokens", "return_token_strs"}
    assert set(bodies["DetokenizeBody"]["properties"]) == {"model", "tokens"}
    assert set(bodies["TokenizeResponse"]["properties"]) == {"count", "max_model_len", "tokens", "token_strs"}
    forms = bodies["CompletionBody"]["properties"]["prompt"]["anyOf"]
    assert forms[:3] == [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
    ]
    assert forms[3]["items"] == forms[2] and forms[4:] == [{"type": "null"}]  # null: the default, "" (unconditional)
