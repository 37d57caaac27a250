"""/v1/generate with a prompt (serve/api/prompted.py): the prompt is inpainted, and the answer, plain
or streamed with its previews, is of what follows it, checked against the eager PyTorch pipeline of
the checkpoint the served graphs were exported from; real server on 127.0.0.1, real httpx streams."""

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
    """The continuation's token ids and text from the eager pipeline, the prompt's positions cut off."""
    ids = pipeline.tokenizer.encode([PROMPT])[0]
    row = pipeline.generate(1, len(ids) + length, steps, seed, "ddim", prompt=ids).token_ids[0, len(ids) :].tolist()
    return row, pipeline.tokenizer.decode(row)


PLAN = {
    "sampler": "ddim",
    "steps": 20,
    "grid": "uniform",
    "t_min": 0.05,
    "prior_temperature": 1.0,
    "prompt_strength": 1.0,
}  # what a ddim@20 request on the tiny config runs, as its answer names it


def test_a_prompted_generation_answers_what_follows_the_prompt(server: RunningServer, pipeline: LDLMPipeline) -> None:
    body = {"n": 1, "length": 12, "steps": 20, "seed": 7, "sampler": "ddim", "prompt": PROMPT}
    answer = httpx.post(f"{server.url}/v1/generate", json=body, timeout=60).json()
    ids, text = reference(pipeline, 12, 20, 7)
    assert answer == {"texts": [text], "token_ids": [ids], "plan": PLAN}
    unprompted = httpx.post(f"{server.url}/v1/generate", json={**body, "prompt": ""}, timeout=60).json()
    assert len(unprompted["token_ids"][0]) == 12 and unprompted != answer  # "" is no prompt: 12 tokens, unconditioned


def test_a_prompted_stream_previews_what_follows_the_prompt(server: RunningServer, pipeline: LDLMPipeline, monkeypatch) -> None:
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
        assert sample["text"] == pipeline.tokenizer.decode(whole[kept:]), sample  # the positions after the prompt


def test_a_prompt_too_long_for_the_length_is_refused_naming_both(server: RunningServer) -> None:
    body = {"n": 1, "length": 126, "steps": 4, "prompt": PROMPT}  # 4 prompt tokens + 126 > 128
    response = httpx.post(f"{server.url}/v1/generate", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"] == (
        "prompt has 4 tokens and length is 126: 130 tokens in all; allowed: up to 128 (the model's max_seq_len)"
    )
    blank = httpx.post(f"{server.url}/v1/generate", json={**body, "length": 8, "prompt": "  "}, timeout=60)
    assert blank.status_code == 400 and "is blank" in blank.json()["error"]


def test_a_prompt_strength_reaches_the_scheduler_plain_and_streamed(server: RunningServer, pipeline: LDLMPipeline) -> None:
    """prompt_strength guides the served samples as the pipeline's: the scheduler's engine reads it from the plan."""
    body = {"n": 2, "length": 10, "steps": 6, "seed": 3, "sampler": "ddim", "prompt": PROMPT, "prompt_strength": 2.5}
    ids = pipeline.tokenizer.encode([PROMPT])[0]
    guided = pipeline.generate(2, len(ids) + 10, 6, 3, "ddim", prompt=ids, prompt_strength=2.5)
    inpainted = pipeline.generate(2, len(ids) + 10, 6, 3, "ddim", prompt=ids)
    rows = [row[len(ids) :].tolist() for row in guided.token_ids]
    assert rows != [row[len(ids) :].tolist() for row in inpainted.token_ids]  # the strength changes the continuation
    plan = {**PLAN, "steps": 6, "prompt_strength": 2.5}
    answer = httpx.post(f"{server.url}/v1/generate", json=body, timeout=60).json()
    assert answer == {"texts": [pipeline.tokenizer.decode(r) for r in rows], "token_ids": rows, "plan": plan}
    with httpx.stream("POST", f"{server.url}/v1/generate", json={**body, "stream": True, "preview_every": 2}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert sse_events(response.iter_lines())[-1][1] == answer
