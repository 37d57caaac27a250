from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ldlm.checkpoint import init_model, save_checkpoint
from ldlm.config import LDLMConfig, preset
from ldlm.model import LDLM
from ldlm.pipeline import LDLMPipeline
from ldlm.tokenizer import TextTokenizer

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_config() -> LDLMConfig:
    return preset("tiny")


@pytest.fixture(scope="session")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.gpt2()


@pytest.fixture(scope="session")
def tiny_model(tiny_config: LDLMConfig) -> LDLM:
    """Random init, but like a trained checkpoint every LayerNorm has its own gain and bias (at init
    they are all ones and zeros, which the exporter deduplicates into one shared initializer)."""
    model = init_model(tiny_config, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(1 + 0.1 * torch.randn(module.weight.shape, generator=gen))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=gen))
    return model


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny_model: LDLM, tokenizer: TextTokenizer) -> Path:
    return save_checkpoint(tiny_model, tokenizer, tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def pipeline(tiny_checkpoint: Path) -> LDLMPipeline:
    return LDLMPipeline.from_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="session")
def export_dir(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint exported to ONNX (decoder with logits), shared by the ONNX and engine tests."""
    from ldlm.export.onnx_export import export_graphs

    out = tmp_path_factory.mktemp("export") / "onnx"
    export_graphs(tiny_checkpoint, out, with_logits=True)
    return out
