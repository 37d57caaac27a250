"""Reconstructed token ids hold each text's own positions only, never the batch's padding.

The reference is each text run alone (no padding at all) and the tokenizer's own count of its ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ldlm.cli import main
from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline

SHORT = "Hello world"
LONG = "A much longer sentence about latent diffusion models."


def test_batched_ids_equal_each_text_alone(pipeline: LDLMPipeline) -> None:
    batched = pipeline.reconstruct([SHORT, LONG]).ids()
    alone = [pipeline.reconstruct([text]).ids()[0] for text in (SHORT, LONG)]
    assert [len(row) for row in batched] == [len(row) for row in pipeline.tokenizer.encode([SHORT, LONG])]
    assert len(batched[0]) == 2 < len(batched[1])
    assert batched == alone


def test_generated_ids_keep_the_requested_length(pipeline: LDLMPipeline) -> None:
    result = pipeline.generate(n=2, length=5, steps=2, seed=0, sampler="ddim")
    assert result.ids() == result.token_ids.tolist() and [len(row) for row in result.ids()] == [5, 5]


def test_cli_reconstruct_json_has_no_padded_ids(tiny_checkpoint: Path, pipeline: LDLMPipeline, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reconstruct", str(tiny_checkpoint), SHORT, LONG, "--json"]) == 0
    token_ids = json.loads(capsys.readouterr().out)["token_ids"]
    assert token_ids == [pipeline.reconstruct([text]).ids()[0] for text in (SHORT, LONG)]
    assert len(token_ids[0]) == 2


def test_http_reconstruct_has_no_padded_ids(export_dir: Path) -> None:
    pytest.importorskip("onnxruntime", reason="the served graphs run on ONNX Runtime (pip install -e .[cpu])")
    httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")
    from ldlm.serve.api.service import LDLMService, ServerSettings
    from tests.servers import RunningServer, free_port

    running = RunningServer(LDLMService(str(export_dir), ServerSettings(port=free_port(), max_batch=8)))
    try:
        with httpx.Client(base_url=running.url, timeout=60) as http:
            batched = http.post("/v1/reconstruct", json={"texts": [SHORT, LONG]}).json()["token_ids"]
            alone = [http.post("/v1/reconstruct", json={"texts": [text]}).json()["token_ids"][0] for text in (SHORT, LONG)]
    finally:
        running.stop()
    tokenizer_counts = [len(row) for row in TextTokenizer.from_directory(export_dir).encode([SHORT, LONG])]
    assert [len(row) for row in batched] == tokenizer_counts
    assert batched == alone
