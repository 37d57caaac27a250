"""The one base-size path in the suite: the paper's sizes build, encode, denoise and decode on CPU."""

from __future__ import annotations

import torch

from ldlm.model.checkpoint import init_model
from ldlm.model.config import preset
from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline


def test_base_generate_and_reconstruct() -> None:
    model = init_model(preset("base"), seed=0)
    pipeline = LDLMPipeline(model, TextTokenizer.gpt2())
    result = pipeline.generate(n=1, length=16, steps=2, seed=0, sampler="ddim")
    assert result.token_ids.shape == (1, 16)
    latents = pipeline.encode(["A base-size smoke test."]).latents
    assert latents.shape[-1] == 768 and torch.isfinite(latents).all()
    assert len(pipeline.reconstruct(["A base-size smoke test."]).texts) == 1
