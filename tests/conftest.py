from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ldlm.model.checkpoint import init_model, save_checkpoint
from ldlm.model.config import LDLMConfig, preset
from ldlm.model.ldlm import LDLM
from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline

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


@pytest.fixture(scope="session")
def int8_export_dir(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint exported with INT8 variants of the denoiser and the decoder (which has LayerNorms)."""
    from ldlm.export.onnx_export import export_graphs

    out = tmp_path_factory.mktemp("int8") / "onnx"
    return export_graphs(tiny_checkpoint, out, quantize="int8", quantize_graphs=("denoiser", "decoder")).out


# --- groups: `pytest -m "not slow"` for a quick loop, `-m e2e` for the whole-product runs, `-m gpu` on a GPU ---
SLOW_MODULES = (
    "serve/deploy/test_triton_server.py",
    "serve/deploy/test_triton_server_clients.py",
    "serve/deploy/test_ray_app.py",
    "e2e/test_base_smoke.py",
)  # real servers, base size


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        where = Path(str(item.fspath)).relative_to(tests).as_posix()
        if where.startswith("e2e/"):
            item.add_marker(pytest.mark.e2e)
        if where in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        reasons = [str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")]
        if any(("CUDA" in r or "GPU" in r) and "is available" not in r for r in reasons):  # need a device to run at all
            item.add_marker(pytest.mark.gpu)
