"""/v1/generate with a prompt (serve/api/prompted.py): the prompt is inpainted, ``length`` counts it, and the
answer, plain or streamed with its previews, starts with it verbatim, as ``LDLMPipeline.generate(prompt=)``
and ``ldlm generate --prompt`` answer: checked against the eager PyTorch pipeline of the checkpoint the served
graphs were exported from; real server on 127.0.0.1, real httpx streams."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")

from ldlm.pipeline import LDLMPipeline  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from scripts.harness.traffic import sse_events  # noqa: E402
from tests.servers import RunningServer, free_port  # noqa: E402

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server(export_dir: Path):
    settings = ServerSettings(
        port=free_port(), max_batch=8, request_timeout_s=60, max_n=4, max_steps=200, preview_lone_budget=1.0
    )  # every preview, to check each one
    running = RunningServer(LDLMService(str(export_dir), settings))
    yield running
    running.stop()


def reference(pipeline: LDLMPipeline, length: int, steps: int, seed: int) -> tuple[list[int], str]:
    """The sample's token ids and text from the eager pipeline, given the prompt as text (as the CLI gives it)."""
    result = pipeline.generate(1, length, steps, seed, "ddim", prompt=PROMPT)
    return result.token_ids[0].tolist(), result.texts[0]


PLAN = {
    "sampler": "ddim",
    "steps": 20,
    "grid": "uniform",
    "t_min": 0.05,
    "prior_temperature": 1.0,
    "prompt_strength": 1.0,
}  # what a ddim@20 request on the tiny config runs, as its answer names it


def test_a_prompted_generation_answers_the_prompt_and_what_follows_it(server: RunningServer, pipeline: LDLMPipeline) -> None:
    body = {"n": 1, "length": 12, "steps": 20, "seed": 7, "sampler": "ddim", "prompt": PROMPT}
    answer = httpx.post(f"{server.url}/v1/generate", json=body, timeout=60).json()
    ids, text = reference(pipeline, 12, 20, 7)
    assert answer == {"texts": [text], "token_ids": [ids], "plan": PLAN}
    prompt_ids = pipeline.tokenizer.encode([PROMPT])[0]
    assert len(ids) == 12 and ids[: len(prompt_ids)] == prompt_ids and text.startswith(PROMPT)  # length counts the prompt
    unprompted = httpx.post(f"{server.url}/v1/generate", json={**body, "prompt": ""}, timeout=60).json()
    assert len(unprompted["token_ids"][0]) == 12 and unprompted != answer  # "" is no prompt: 12 tokens, unconditioned


def test_a_prompted_stream_previews_start_with_the_prompt(server: RunningServer, pipeline: LDLMPipeline, monkeypatch) -> None:
    offered: list[Any] = []  # the x0_hat of each preview call, in step order, decoded below by the eager pipeline
    decodes = server.service.scheduler.delivery.preview_decodes
    real = decodes.pipeline
    monkeypatch.setattr(
        decodes, "pipeline", SimpleNamespace(decode=lambda latents, mask: (offered.append(latents), real.decode(latents, mask))[1])
    )
    body = {"n": 1, "length": 12, "steps": 20, "seed": 7, "sampler": "ddim", "prompt": PROMPT, "stream": True, "preview_every": 5}
    with httpx.stream("POST", f"{server.url}/v1/generate", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        events = sse_events(response.iter_lines())
    assert [k for k, _ in events] == ["preview"] * 3 + ["result"]  # an idle server: steps 5, 10, 15, then the result
    assert [e["samples"][0]["step"] for _, e in events[:-1]] == [5, 10, 15]
    ids, text = reference(pipeline, 12, 20, 7)
    assert events[-1][1] == {"texts": [text], "token_ids": [ids], "plan": PLAN}
    kept = len(pipeline.tokenizer.encode([PROMPT])[0])
    for x0, (_, event) in zip(offered, events[:-1], strict=True):
        sample = event["samples"][0]
        whole = pipeline.decode(x0.float()).token_ids[0].tolist()
        prompt_ids = pipeline.tokenizer.encode([PROMPT])[0]
        assert sample["text"] == pipeline.tokenizer.decode(prompt_ids + whole[kept:]), sample  # the prompt as given, then x0_hat's


def test_a_prompt_that_leaves_no_room_is_refused_naming_both(server: RunningServer) -> None:
    body = {"n": 1, "length": 4, "steps": 4, "prompt": PROMPT}  # 4 prompt tokens: none left to write
    response = httpx.post(f"{server.url}/v1/generate", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"] == "the prompt is 4 tokens long; allowed: 1..3 tokens (fewer than length=4)"
    assert httpx.post(f"{server.url}/v1/generate", json={**body, "length": 5}, timeout=60).status_code == 200  # the first that fits
    lone = '{"length": 5, "steps": 4, "prompt": "a\\ud800"}'  # a lone surrogate, escaped: no client encodes it raw
    surrogate = httpx.post(f"{server.url}/v1/generate", content=lone, headers={"Content-Type": "application/json"}, timeout=60)
    assert surrogate.status_code == 400 and "prompt is not valid Unicode" in surrogate.json()["error"]
    blank = httpx.post(f"{server.url}/v1/generate", json={**body, "length": 8, "prompt": "  "}, timeout=60)
    assert blank.status_code == 400 and "is blank" in blank.json()["error"]


def test_a_prompt_strength_reaches_the_scheduler_plain_and_streamed(server: RunningServer, pipeline: LDLMPipeline) -> None:
    """prompt_strength guides the served samples as the pipeline's: the scheduler's engine reads it from the plan."""
    body = {"n": 2, "length": 10, "steps": 6, "seed": 3, "sampler": "ddim", "prompt": PROMPT, "prompt_strength": 2.5}
    ids = pipeline.tokenizer.encode([PROMPT])[0]
    guided = pipeline.generate(2, 10, 6, 3, "ddim", prompt=ids, prompt_strength=2.5)
    inpainted = pipeline.generate(2, 10, 6, 3, "ddim", prompt=ids)
    assert guided.ids() != inpainted.ids()  # the strength changes the continuation
    plan = {**PLAN, "steps": 6, "prompt_strength": 2.5}
    answer = httpx.post(f"{server.url}/v1/generate", json=body, timeout=60).json()
    assert answer == {"texts": guided.texts, "token_ids": guided.ids(), "plan": plan}
    with httpx.stream("POST", f"{server.url}/v1/generate", json={**body, "stream": True, "preview_every": 2}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert sse_events(response.iter_lines())[-1][1] == answer
