"""The engine interface: the same contract and answers on every backend, and clear errors."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ldlm.serve.runtime.backends import open_graphs
from ldlm.serve.runtime.graph_backend import BackendError
from ldlm.serve.runtime.torch_backends import EagerBackend

pytest.importorskip("onnxruntime", reason="ONNX Runtime is one of the backends compared (pip install -e .[cpu])")


def test_eager_and_ort_share_the_contract_and_agree(tiny_checkpoint: Path, export_dir: Path) -> None:
    eager, _, _ = open_graphs("eager", tiny_checkpoint)
    ort, config, _ = open_graphs("ort", export_dir)
    for name in ("encoder", "denoiser", "decoder"):
        assert eager[name].input_names == ort[name].input_names
        assert set(eager[name].output_names) <= set(ort[name].output_names)
    assert all(g.provider == "CPUExecutionProvider" for g in ort.values())
    feed = {
        "latents": np.random.default_rng(0).standard_normal((2, 5, config.d_model)).astype(np.float32),
        "attention_mask": np.ones((2, 5), dtype=np.int64),
    }
    np.testing.assert_array_equal(eager["decoder"].run(feed)["token_ids"], ort["decoder"].run(feed)["token_ids"])


def test_inputs_are_checked_at_the_boundary(export_dir: Path) -> None:
    graphs, config, _ = open_graphs("ort", export_dir)
    denoiser = graphs["denoiser"]
    x = np.zeros((1, 4, config.d_model), dtype=np.float32)
    good = {"x_t": x, "t": np.zeros(1, np.float32), "x0_prev": x, "attention_mask": np.ones((1, 4), np.int64)}
    assert denoiser.run(good)["x0_hat"].shape == x.shape
    with pytest.raises(BackendError, match=r"inputs .* do not match; allowed: exactly \['x_t', 't', 'x0_prev', 'attention_mask'\]"):
        denoiser.run({"x_t": x})
    with pytest.raises(BackendError, match="input t has dtype int64; allowed: float32"):
        denoiser.run({**good, "t": np.zeros(1, np.int64)})
    with pytest.raises(BackendError, match=r"axis 2 is 3; allowed: 64"):
        denoiser.run({**good, "x_t": np.zeros((1, 4, 3), np.float32)})
    with pytest.raises(BackendError, match=r"axis 0 \(batch\) is 2, other inputs have 1"):
        denoiser.run({**good, "t": np.zeros(2, np.float32)})
    long = np.zeros((1, config.max_seq_len + 1, config.d_model), np.float32)
    with pytest.raises(BackendError, match=f"1 <= seq <= {config.max_seq_len}"):  # outside the graph's shape range
        denoiser.run(
            {"x_t": long, "t": np.zeros(1, np.float32), "x0_prev": long, "attention_mask": np.ones((1, config.max_seq_len + 1), np.int64)}
        )


def test_missing_backend_and_unsupported_precision(tiny_checkpoint: Path, export_dir: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as on a machine without it
    with pytest.raises(BackendError, match=r"ONNX Runtime is not installed .*pip install -e \.\[cpu\]"):
        open_graphs("ort", export_dir)
    monkeypatch.undo()
    with pytest.raises(BackendError, match="backend 'ort' cannot run precision='bf16'; allowed: fp32, fp16"):
        open_graphs("ort", export_dir, "bf16")
    with pytest.raises(BackendError, match="backend 'eager' cannot run precision='int8'; allowed: fp32, bf16, fp16"):
        open_graphs("eager", tiny_checkpoint, "int8")
    with pytest.raises(BackendError, match="backend='onnx' is unknown; allowed: eager, compiled, inductor, ort, ort-cuda, trt"):
        open_graphs("onnx", export_dir)
    with pytest.raises(BackendError, match="has no config.json"):
        open_graphs("ort", tiny_checkpoint.parent)
    with pytest.raises(BackendError, match="cuda_graphs applies to engine backends only, not 'ort'"):
        open_graphs("ort", export_dir, cuda_graphs=True)


def test_ort_fp16_runs_the_cast_pass_variant(export_dir: Path, tiny_model) -> None:
    graphs, config, _ = open_graphs("ort", export_dir, "fp16")
    eager = EagerBackend(tiny_model, "denoiser")
    x = np.random.default_rng(1).standard_normal((2, 6, config.d_model)).astype(np.float32)
    feed = {"x_t": x, "t": np.array([0.3, 0.8], np.float32), "x0_prev": x, "attention_mask": np.ones((2, 6), np.int64)}
    got, expected = graphs["denoiser"].run(feed)["x0_hat"], eager.run(feed)["x0_hat"]
    assert got.dtype == np.float32 and np.abs(got - expected).max() < 2e-2 * np.abs(expected).max()
