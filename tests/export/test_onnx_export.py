"""ONNX export of the three graphs on the tiny config: ONNX Runtime (CPU) against eager PyTorch."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

import ldlm
from ldlm.export.artifact import MANIFEST_FILE, sha256_file
from ldlm.export.onnx_export import export_graphs, verify_export
from ldlm.model.ldlm import LDLM

# Only the tests that run a graph need ONNX Runtime; the manifest and verification tests run without it.
needs_ort = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime") is None, reason="ONNX Runtime runs the exported graphs (pip install -e .[cpu])"
)
ATOL = 1e-5


def session(path: Path) -> Any:
    import onnxruntime as ort  # optional: the tests skip without it (importorskip above)

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def test_export_writes_verified_graphs_and_manifest(export_dir: Path, tiny_model: LDLM) -> None:
    manifest = json.loads((export_dir / MANIFEST_FILE).read_text())
    assert manifest["opset"] == 18 and manifest["config_sha256"] == tiny_model.config.config_hash()
    io = {name: (g["inputs"], g["outputs"]) for name, g in manifest["graphs"].items()}
    d, v = tiny_model.config.d_model, tiny_model.config.vocab_size
    assert io["encoder"] == (
        [
            {"name": "input_ids", "dtype": "INT64", "shape": ["batch", "seq"]},
            {"name": "attention_mask", "dtype": "INT64", "shape": ["batch", "seq"]},
        ],
        [{"name": "latents", "dtype": "FLOAT", "shape": ["batch", "seq", d]}],
    )
    assert [i["name"] for i in io["denoiser"][0]] == ["x_t", "t", "x0_prev", "attention_mask"]
    assert [i["name"] for i in io["decoder"][0]] == ["latents", "attention_mask"]
    assert io["denoiser"][0][1]["shape"] == ["batch"]
    assert io["decoder"][1] == [
        {"name": "token_ids", "dtype": "INT64", "shape": ["batch", "seq"]},
        {"name": "logits", "dtype": "FLOAT", "shape": ["batch", "seq", v]},
    ]
    for name, graph in manifest["graphs"].items():
        assert set(graph["files"]) == {f"{name}.onnx", f"{name}.onnx.data"}  # weights as external data
        for file, info in graph["files"].items():
            assert sha256_file(export_dir / file) == info["sha256"]
        model = onnx.load(str(export_dir / graph["file"]), load_external_data=False)
        props = {p.key: p.value for p in model.metadata_props}
        assert props["ldlm.version"] == ldlm.__version__
        assert props["ldlm.config_sha256"] == tiny_model.config.config_hash()
        assert props["ldlm.opset"] == "18" and model.opset_import[0].version == 18
    assert all(r.passed for r in verify_export(export_dir))


@needs_ort
def test_encoder_matches_eager_on_padded_batches(export_dir: Path, tiny_model: LDLM) -> None:
    sess = session(export_dir / "encoder.onnx")
    gen = torch.Generator().manual_seed(0)
    for batch, length in ((3, 13), (1, 5), (5, 32)):  # the export example was (2, 8)
        ids = torch.randint(0, tiny_model.config.gpt2_vocab_size, (batch, length), generator=gen)
        mask = torch.ones(batch, length, dtype=torch.int64)
        mask[0, length // 2 :] = 0  # right padding on the first row
        (got,) = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
        with torch.no_grad():
            expected = tiny_model.encode_latents(ids, mask.bool()).numpy()
        assert got.shape == expected.shape
        assert np.abs(got - expected).max() <= ATOL, (batch, length)


@needs_ort
def test_denoiser_matches_eager_with_per_sample_times(export_dir: Path, tiny_model: LDLM) -> None:
    sess = session(export_dir / "denoiser.onnx")
    d = tiny_model.config.d_model
    gen = torch.Generator().manual_seed(1)
    for batch, length in ((3, 11), (1, 4), (6, 64)):
        x_t, x0 = torch.randn(batch, length, d, generator=gen), torch.randn(batch, length, d, generator=gen)
        t = torch.rand(batch, generator=gen)
        mask = torch.ones(batch, length, dtype=torch.int64)
        mask[-1, length // 2 :] = 0
        feed = {"x_t": x_t.numpy(), "t": t.numpy(), "x0_prev": x0.numpy(), "attention_mask": mask.numpy()}
        (got,) = sess.run(None, feed)
        with torch.no_grad():
            expected = tiny_model.denoise(x_t, t, x0, mask.bool()).numpy()
        assert np.abs(got - expected).max() <= ATOL, (batch, length)


@needs_ort
def test_decoder_matches_eager_tokens_and_logits(export_dir: Path, tiny_model: LDLM) -> None:
    sess = session(export_dir / "decoder.onnx")
    d = tiny_model.config.d_model
    gen = torch.Generator().manual_seed(2)
    for batch, length in ((3, 9), (1, 3), (4, 40)):
        latents = torch.randn(batch, length, d, generator=gen)
        mask = torch.ones(batch, length, dtype=torch.int64)
        mask[0, (length + 1) // 2 :] = 0
        token_ids, logits = sess.run(None, {"latents": latents.numpy(), "attention_mask": mask.numpy()})
        with torch.no_grad():
            expected = tiny_model.decode_logits(latents, mask.bool())
        assert np.abs(logits - expected.numpy()).max() <= ATOL
        np.testing.assert_array_equal(token_ids, expected.argmax(-1).numpy())


def test_verify_against_the_checkpoint_modules(export_dir: Path, tiny_checkpoint: Path) -> None:
    results = verify_export(export_dir / "decoder.onnx", tiny_checkpoint)
    assert [r.graph for r in results] == ["decoder"] and results[0].passed
    assert results[0].layer_norm_nodes == results[0].layer_norm_modules == 6


def test_opset_20_gives_single_gelu_nodes(tiny_checkpoint: Path, tmp_path: Path) -> None:
    result = export_graphs(tiny_checkpoint, tmp_path / "o20", opset=20, graphs=("decoder",))
    model = onnx.load(str(tmp_path / "o20" / "decoder.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert model.opset_import[0].version == 20 and "Gelu" in ops and "Erf" not in ops
    assert result.verification[0].passed


def test_bad_inputs_leave_nothing_behind(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="opset=17 is unsupported; allowed: 18, 20"):
        export_graphs(tiny_checkpoint, tmp_path / "a", opset=17)
    with pytest.raises(ValueError, match="missing"):
        export_graphs(tmp_path / "missing", tmp_path / "b")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="cannot create"):
        export_graphs(tiny_checkpoint, blocker / "c", graphs=("denoiser",))
    with pytest.raises(ValueError, match="graphs="):
        export_graphs(tiny_checkpoint, tmp_path / "d", graphs=("vae",))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "notes.txt").write_text("mine")  # an empty directory would be written into
    with pytest.raises(FileExistsError, match="--force"):
        export_graphs(tiny_checkpoint, tmp_path / "e", graphs=("denoiser",))
