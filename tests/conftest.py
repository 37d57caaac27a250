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
    """Random init with realistic norms (``ldlm init --norm-init random``): like a trained checkpoint,
    every LayerNorm and RMSNorm has its own scale and bias and the standardization statistics are not
    the identity (at init the norms are all ones and zeros, which the exporter shares as one initializer)."""
    return init_model(tiny_config, seed=0, norm_init="random")


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
