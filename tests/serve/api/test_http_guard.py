"""Guards of the served routes that a random-init model never reaches, forced and checked against
hand-written expectations, through the real server on 127.0.0.1:

- the end-of-text cut of an OpenAI completion: a random-init decoder never emits end-of-text, so
  here the decoder's ids are replaced by known rows (``ForcedDecoder``) with end-of-text at a known
  position: the text stops there, finish_reason is "stop", and usage counts only the tokens before it;
- NaN, +Infinity and -Infinity in KServe tensors, JSON and binary: 400 naming the input.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")
openai = pytest.importorskip("openai", reason="the OpenAI client under test (pip install -e .[test])")
from ldlm.serve.api.kserve import HEADER_LENGTH  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from tests.servers import RunningServer, free_port, openai_client  # noqa: E402

EOS = 50256  # GPT-2's <|endoftext|>
HELLO = [18435, 612]  # " Hello there"
WORLD = 995  # " world"
PROMPT = "Hi there"  # 2 tokens: [17250, 612]


@pytest.fixture(scope="module")
def server(export_dir: Path):
    settings = ServerSettings(
        port=free_port(), max_batch=8, request_timeout_s=60, max_n=8, max_texts=4, max_steps=50, max_body_bytes=1 << 20
    )
    running = RunningServer(LDLMService(str(export_dir), settings))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer):
    with openai_client(server) as client:
        yield client


class ForcedDecoder:
    """The generation graphs with ``decode_tokens`` overwritten: row i of every decoded batch starts
    with ``rows[i % len(rows)]`` (the rest of the row is what the real decoder made). A request's
    samples are decoded together, in order, maybe after another request's: with len(rows) = n the
    rows follow the sample index."""

    def __init__(self, graphs, rows: list[list[int]]) -> None:
        self.graphs, self.rows = graphs, rows

    def __getattr__(self, name: str):
        return getattr(self.graphs, name)

    def decode_tokens(self, latents: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ids = self.graphs.decode_tokens(latents, mask).clone()
        for i in range(ids.shape[0]):
            row = self.rows[i % len(self.rows)]
            ids[i, : len(row)] = torch.tensor(row[: ids.shape[1]])
        return ids


@pytest.fixture
def force(server: RunningServer, monkeypatch):
    pipeline = server.service.scheduler.pipeline

    def install(*rows: list[int]) -> None:
        monkeypatch.setattr(pipeline, "graphs", ForcedDecoder(pipeline.graphs, list(rows)))

    return install


def complete(client, **kwargs):
    return client.completions.create(model="ldlm", extra_body={"steps": 2, "sampler": "ddim"}, **kwargs)


# --- the end-of-text cut ----------------------------------------------------------------------------


def test_completion_stops_at_end_of_text_and_counts_only_the_tokens_before_it(client, force) -> None:
    force(HELLO + [EOS] + [WORLD] * 7, [WORLD] * 10)  # choice 0 ends after " Hello there"; choice 1 never ends
    result = complete(client, prompt="", max_tokens=10, n=2, seed=1)
    assert [(c.index, c.text, c.finish_reason) for c in result.choices] == [(0, " Hello there", "stop"), (1, " world" * 10, "length")]
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (0, 12, 12)


def test_end_of_text_first_gives_an_empty_stopped_completion(client, force) -> None:
    force([EOS] + HELLO + [WORLD] * 5)
    result = complete(client, prompt="", max_tokens=8, seed=2)
    assert (result.choices[0].text, result.choices[0].finish_reason, result.usage.completion_tokens) == ("", "stop", 0)


def test_end_of_text_in_the_prompt_positions_does_not_cut_the_completion(client, force) -> None:
    """The completion starts after the prompt's 2 positions: an end-of-text the decoder put there
    (they are replaced by the prompt) must not end it; the one after " Hello there" does."""
    force([EOS, EOS] + HELLO + [EOS] + [WORLD] * 5)
    result = complete(client, prompt=PROMPT, max_tokens=8, seed=3)
    assert (result.choices[0].text, result.choices[0].finish_reason) == (" Hello there", "stop")
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (2, 2)


def test_streamed_choices_are_cut_the_same_way(client, force) -> None:
    force([WORLD] + [EOS] * 5, HELLO + [WORLD] * 4)
    chunks = list(complete(client, prompt="", max_tokens=6, n=2, seed=4, stream=True, stream_options={"include_usage": True}))
    got = {c.index: (c.text, c.finish_reason) for chunk in chunks for c in chunk.choices}
    assert got == {0: (" world", "stop"), 1: (" Hello there" + " world" * 4, "length")}
    assert chunks[-1].usage.completion_tokens == 1 + 6


def test_each_prompt_of_a_list_is_cut_on_its_own_row(client, force) -> None:
    """Two prompts x n=2: choices 0..3 in order, each row cut at its own end-of-text. (Each prompt is
    its own request, decoded alone or with the other one: the forced rows follow the sample index.)"""
    force(HELLO + [EOS] * 4, [WORLD] * 6)
    result = complete(client, prompt=["", ""], max_tokens=6, n=2, seed=5)
    assert [(c.index, c.text, c.finish_reason) for c in result.choices] == [
        (0, " Hello there", "stop"),
        (1, " world" * 6, "length"),
        (2, " Hello there", "stop"),
        (3, " world" * 6, "length"),
    ]
    assert result.usage.completion_tokens == 2 + 6 + 2 + 6


# --- NaN and Infinity in KServe tensors ---------------------------------------------------------------

BAD = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def denoiser_arrays(bad: float) -> dict[str, np.ndarray]:
    x = np.zeros((1, 3, 64), np.float32)
    x0_prev = np.zeros((1, 3, 64), np.float32)
    x0_prev[0, 2, 17] = bad  # one element of the third input
    return {"x_t": x, "t": np.array([0.5], np.float32), "x0_prev": x0_prev, "attention_mask": np.ones((1, 3), np.int64)}


def kserve_body(arrays: dict[str, np.ndarray], binary: bool) -> tuple[bytes, dict[str, str]]:
    """A KServe v2 body written by hand: JSON data (json.dumps writes NaN, Infinity, -Infinity), or
    the binary extension (JSON header, then the raw bytes of each tensor in input order)."""
    datatypes = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}
    inputs, blobs = [], b""
    for name, array in arrays.items():
        spec = {"name": name, "shape": list(array.shape), "datatype": datatypes[array.dtype]}
        if binary:
            spec["parameters"] = {"binary_data_size": array.nbytes}
            blobs += array.tobytes()
        else:
            spec["data"] = array.reshape(-1).tolist()
        inputs.append(spec)
    head = json.dumps({"inputs": inputs}).encode()
    headers = (
        {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(head))} if binary else {"Content-Type": "application/json"}
    )
    return head + blobs, headers


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
def test_non_finite_tensor_values_are_refused_naming_the_input(server: RunningServer, bad: str, binary: bool) -> None:
    body, headers = kserve_body(denoiser_arrays(BAD[bad]), binary)
    if not binary:
        assert {"nan": b"NaN", "inf": b"Infinity", "-inf": b"-Infinity"}[bad] in body  # the JSON spelling a client sends
    response = httpx.post(f"{server.url}/v2/models/denoiser/infer", content=body, headers=headers, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json() == {"error": "inputs[2] (x0_prev): data holds NaN or Infinity; allowed: finite numbers"}


def test_the_same_body_with_finite_values_is_answered(server: RunningServer) -> None:
    """The refusal is about the value: the same request with 0.0 there gets x0_hat."""
    for binary in (False, True):
        body, headers = kserve_body(denoiser_arrays(0.0), binary)
        response = httpx.post(f"{server.url}/v2/models/denoiser/infer", content=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
def test_tritonclient_binary_tensor_with_non_finite_values_is_refused(server: RunningServer, bad: str) -> None:
    tritonclient_http = pytest.importorskip("tritonclient.http", reason="the Triton client under test (pip install -e .[test])")
    from tritonclient.utils import InferenceServerException

    client = tritonclient_http.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        inputs = []
        for name, array in denoiser_arrays(BAD[bad]).items():
            tensor = tritonclient_http.InferInput(name, list(array.shape), "FP32" if array.dtype == np.float32 else "INT64")
            tensor.set_data_from_numpy(array, binary_data=True)
            inputs.append(tensor)
        with pytest.raises(InferenceServerException) as error:
            client.infer("denoiser", inputs)
        assert error.value.status() == "400"
        assert "inputs[2] (x0_prev): data holds NaN or Infinity" in error.value.message()
    finally:
        client.close()


# --- the completion request's limits at their edges ------------------------------------------------------


def post_completion(server: RunningServer, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"model": "ldlm", "steps": 1, "sampler": "ddim", **body}, timeout=60)


def openai_message(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    return response.json()["error"]["message"]


def test_prompt_list_and_choices_at_their_limits(server: RunningServer) -> None:
    """max_texts=4 prompts and max_n=8 choices in all (prompts x n)."""
    ok = post_completion(server, prompt=["", "", "", ""], n=2, max_tokens=1)
    assert ok.status_code == 200 and [c["index"] for c in ok.json()["choices"]] == list(range(8))
    assert openai_message(post_completion(server, prompt=[""] * 5, max_tokens=1)) == "prompt has 5 items; allowed: 1..4"
    assert openai_message(post_completion(server, prompt=[], max_tokens=1)).startswith(
        "prompt is an empty list; allowed: a text, a list of 1..4 texts, a list of token ids, or a list of 1..4 token-id lists"
    )
    assert (
        openai_message(post_completion(server, prompt=["", "", ""], n=3, max_tokens=1))
        == "3 prompts x n=3 is 9 choices; allowed: up to 8 per request"
    )


def test_prompt_plus_max_tokens_fills_max_seq_len_exactly(server: RunningServer) -> None:
    """ " x" is one token: 120 of them + max_tokens 8 = 128 = max_seq_len, allowed; 9 is one too many."""
    prompt = " x" * 120
    ok = post_completion(server, prompt=prompt, max_tokens=8)
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 120
    assert (
        openai_message(post_completion(server, prompt=prompt, max_tokens=9))
        == "prompt has 120 tokens and max_tokens is 9: 129 tokens in all; allowed: up to 128 (the model's max_seq_len)"
    )
    assert openai_message(post_completion(server, prompt=["", prompt], max_tokens=9)).startswith("prompt[1] has 120 tokens")
    assert (
        openai_message(post_completion(server, prompt="   ", max_tokens=1))
        == "prompt='   ' is blank; allowed: text with a non-space character, or \"\" for none"
    )


def test_each_prompt_of_a_list_gets_the_next_seed(client, pipeline) -> None:
    """Prompt i samples with seed + i (mod 2**63): two empty prompts are two independent runs, each the
    eager pipeline's run at its seed, and the seed after 2**63 - 1 is 0."""
    for seed in (9, 2**63 - 1):
        result = complete(client, prompt=["", ""], max_tokens=6, seed=seed)
        for choice, own in zip(result.choices, (seed, (seed + 1) % 2**63)):
            expected = pipeline.generate(1, 6, 2, own, "ddim")
            assert choice.text == expected.texts[0], (seed, choice.index)


def test_unknown_outputs_are_named(server: RunningServer) -> None:
    body, headers = kserve_body(denoiser_arrays(0.0), binary=False)
    request = {**json.loads(body), "outputs": [{"name": "x0_hat"}, {"name": "latents"}]}
    response = httpx.post(f"{server.url}/v2/models/denoiser/infer", json=request, timeout=60)
    assert response.status_code == 400 and response.json() == {"error": "unknown outputs ['latents']; denoiser has ['x0_hat']"}
