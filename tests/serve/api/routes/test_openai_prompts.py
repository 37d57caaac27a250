"""/v1/completions' prompt in OpenAI's four forms (a text, a list of texts, a list of token ids, a list of
token-id lists), against the real server on 127.0.0.1 through the official ``openai`` client. The reference
is a second route: each prompt sent as text through /v1/generate with the same seed and plan. Token ids
are GPT-2's, written out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")
openai = pytest.importorskip("openai", reason="the OpenAI client under test (pip install -e .[test])")

from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from tests.servers import RunningServer, free_port, openai_client  # noqa: E402

STEPS, MAX_TEXTS, MAX_N = 3, 4, 8
PLAN = {"steps": STEPS, "sampler": "ddim"}
# GPT-2's BPE: "I" 40, " was" 373, " a" 257; "Hello" 15496, " world" 995; <|endoftext|> 50256, the last of 50257
I_WAS_A, HELLO_WORLD = [40, 373, 257], [15496, 995]
EOS, VOCABULARY = 50256, 50257


@pytest.fixture(scope="module")
def server(export_dir: Path):
    settings = ServerSettings(port=free_port(), max_batch=8, request_timeout_s=60, max_n=MAX_N, max_texts=MAX_TEXTS, max_steps=50)
    running = RunningServer(LDLMService(str(export_dir), settings))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer):
    with openai_client(server) as client:
        yield client


def complete(client, prompt, **kwargs):
    return client.completions.create(model="ldlm", prompt=prompt, extra_body=PLAN, **kwargs)


def generated(server: RunningServer, text: str, n: int, length: int, seed: int) -> list[tuple[str, str, int]]:
    """Per sample of /v1/generate with ``text`` as its prompt and ``length`` tokens after it: (what follows the
    prompt, finish_reason, tokens before end-of-text). /v1/generate's length counts the prompt, and its answer
    starts with it verbatim."""
    kept = len(server.service.pipeline.tokenizer.encode([text])[0])
    body = {"prompt": text, "n": n, "length": kept + length, "seed": seed, **PLAN}
    answer = httpx.post(f"{server.url}/v1/generate", json=body, timeout=60).json()
    out = []
    for whole, ids in zip(answer["texts"], answer["token_ids"]):
        assert whole.startswith(text)
        after = ids[kept:]
        stop = EOS in after
        out.append((whole[len(text) :], "stop" if stop else "length", after.index(EOS) if stop else len(after)))
    return out


def test_the_token_ids_written_here_are_gpt2s(server: RunningServer) -> None:
    """The hand-written ids are what the served tokenizer makes of the texts (else the comparisons below compare nothing)."""
    tokenizer = server.service.pipeline.tokenizer
    assert tokenizer.encode(["I was a", "Hello world"]) == [I_WAS_A, HELLO_WORLD]
    assert (tokenizer.eos_token_id, server.service.config.gpt2_vocab_size) == (EOS, VOCABULARY)


@pytest.mark.parametrize(
    "prompt",
    [["I was a", "Hello world"], [I_WAS_A, HELLO_WORLD], ["I was a"], [I_WAS_A], "I was a", I_WAS_A],
    ids=["texts", "token-id-lists", "one-text-in-a-list", "one-id-list-in-a-list", "text", "token-ids"],
)
def test_each_prompt_form_completes_as_its_text_through_generate(client, server: RunningServer, prompt) -> None:
    """n choices per prompt, indexed prompt by prompt (vLLM's order: prompt i's are i*n .. i*n + n-1), each the
    sample /v1/generate gives for the prompt's text at seed + i; usage counts each prompt's tokens once."""
    texts = ["I was a", "Hello world"]
    prompts = 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt)
    result = complete(client, prompt, max_tokens=8, n=2, seed=7)
    expected = [choice for i in range(prompts) for choice in generated(server, texts[i], 2, 8, 7 + i)]
    assert [(c.index, c.text, c.finish_reason) for c in result.choices] == [(k, t, r) for k, (t, r, _) in enumerate(expected)]
    prompt_tokens = [3, 2][:prompts]  # I_WAS_A, HELLO_WORLD: counted once each, not once per choice
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (sum(prompt_tokens), sum(n for _, _, n in expected))
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_token_id_prompts_stream_what_they_answer_whole(client) -> None:
    plain = complete(client, [I_WAS_A, HELLO_WORLD], max_tokens=6, n=2, seed=3)
    chunks = list(complete(client, [I_WAS_A, HELLO_WORLD], max_tokens=6, n=2, seed=3, stream=True, stream_options={"include_usage": True}))
    assert {c.index: c.text for chunk in chunks for c in chunk.choices} == {c.index: c.text for c in plain.choices}
    assert chunks[-1].usage == plain.usage


def test_echo_of_a_token_id_prompt_is_its_text(client) -> None:
    """vLLM echoes a token-id prompt decoded; an end-of-text token in it is spelled out, not where its text ends."""
    plain = complete(client, [I_WAS_A, HELLO_WORLD], max_tokens=5, seed=4)
    echoed = complete(client, [I_WAS_A, HELLO_WORLD], max_tokens=5, seed=4, echo=True)
    assert [c.text for c in echoed.choices] == ["I was a" + plain.choices[0].text, "Hello world" + plain.choices[1].text]
    assert echoed.usage == plain.usage  # echo adds no tokens to either count, as vLLM counts
    with_eos = complete(client, [15496, EOS, 995], max_tokens=5, seed=4, echo=True).choices[0].text
    assert with_eos.startswith("Hello<|endoftext|> world")


ALLOWED = (
    f"allowed: a text, a list of 1..{MAX_TEXTS} texts, a list of token ids, or a list of 1..{MAX_TEXTS} token-id lists, "
    'one form per request ("" samples unconditionally)'
)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], f"prompt is an empty list; {ALLOWED}"),
        (["I was", 40], f"prompt[1] is a number (40) in a list of texts; {ALLOWED}"),
        ([[40], "a"], f'prompt[1] is a text ("a") in a list of token-id lists; {ALLOWED}'),
        ([[40], []], f"prompt[1] is an empty list in a list of token-id lists; {ALLOWED}"),
        ([True], f"prompt[0] is a boolean (true); {ALLOWED}"),
        (5, f"prompt is a number (5); {ALLOWED}"),
        ({"text": "a"}, f"prompt is an object; {ALLOWED}"),
        ([40, "a"], 'prompt[1] is a text ("a"); allowed: token ids, integers 0..50256'),
        ([40, 1.5], "prompt[1] is a number (1.5); allowed: token ids, integers 0..50256"),
        ([40, VOCABULARY], "prompt[1]=50257 is out of the vocabulary; allowed: token ids 0..50256"),
        ([-1], "prompt[0]=-1 is out of the vocabulary; allowed: token ids 0..50256"),
        ([[40], [373, 10**6]], "prompt[1][1]=1000000 is out of the vocabulary; allowed: token ids 0..50256"),
        ([[40], [373, False]], "prompt[1][1] is a boolean (false); allowed: token ids, integers 0..50256"),
    ],
    ids=[
        "empty",
        "text-then-id",
        "id-lists-then-text",
        "empty-id-list",
        "boolean",
        "number",
        "object",
        "id-then-text",
        "float-id",
        "mask-token",
        "negative",
        "huge-in-a-list",
        "boolean-in-a-list",
    ],
)
def test_a_bad_prompt_form_is_a_400_in_openais_shape_naming_what_is_allowed(client, prompt, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        complete(client, prompt, max_tokens=4)
    assert raised.value.status_code == 400
    assert raised.value.body == {"message": message, "type": "invalid_request_error", "param": "prompt", "code": None}


def test_the_request_caps_hold_for_token_id_prompts(server: RunningServer) -> None:
    """max_seq_len for a token-id prompt and max_tokens together, max_texts prompts, max_n choices in all."""

    def refusal(**body) -> str:
        response = httpx.post(f"{server.url}/v1/completions", json={"model": "ldlm", **PLAN, **body}, timeout=60)
        assert response.status_code == 400, response.text
        return response.json()["error"]["message"]

    max_seq_len = server.service.config.max_seq_len
    fills = [40] * (max_seq_len - 4)  # with max_tokens 4: exactly max_seq_len, allowed
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": "ldlm", "prompt": fills, "max_tokens": 4, **PLAN}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == max_seq_len - 4
    assert refusal(prompt=fills, max_tokens=5) == (
        f"prompt has {max_seq_len - 4} tokens and max_tokens is 5: {max_seq_len + 1} tokens in all; "
        f"allowed: up to {max_seq_len} (the model's max_seq_len)"
    )
    assert refusal(prompt=[[40], fills], max_tokens=5).startswith(f"prompt[1] has {max_seq_len - 4} tokens")
    assert refusal(prompt=[[40]] * (MAX_TEXTS + 1), max_tokens=1) == f"prompt has {MAX_TEXTS + 1} items; allowed: 1..{MAX_TEXTS}"
    assert refusal(prompt=[[40]] * 3, n=3, max_tokens=1) == f"3 prompts x n=3 is 9 choices; allowed: up to {MAX_N} per request"


def test_a_blank_text_prompt_is_refused_by_its_name(server: RunningServer) -> None:
    response = httpx.post(f"{server.url}/v1/completions", json={"model": "ldlm", "prompt": ["a", "  "], "max_tokens": 1}, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "prompt[1]='  ' is blank; allowed: text with a non-space character, or \"\" for none"


def test_a_prompt_that_is_not_unicode_is_refused_by_its_name(server: RunningServer) -> None:
    """A lone surrogate (JSON's "\\ud800", which clients' encoders will not send, hence the raw body) is no text the
    tokenizer takes: 400 naming where, not a 500."""
    raw = b'{"model": "ldlm", "prompt": ["a", "b\\ud800"], "max_tokens": 1}'
    response = httpx.post(f"{server.url}/v1/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 400
    assert (
        response.json()["error"]["message"] == "prompt[1] is not valid Unicode (surrogates not allowed at character 1); allowed: UTF-8 text"
    )
