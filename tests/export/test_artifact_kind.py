"""A directory given to the wrong backend is named for what it is: `ldlm build-engine`'s plans
(<graph>.plan beside <graph>.plan.json) handed to ONNX Runtime, or an export handed to TensorRT,
with the option that fits. The real CLI; nothing is loaded before the refusal."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ldlm.cli import main


@pytest.fixture
def engine_dir(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """Laid out as `ldlm build-engine` writes it: a plan and its manifest per graph, the config and tokenizer."""
    out = tmp_path / "engines"
    out.mkdir()
    for graph in ("encoder", "denoiser", "decoder"):
        (out / f"{graph}.plan").write_bytes(b"plan")
        (out / f"{graph}.plan.json").write_text('{"ldlm_version": "0"}')
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_checkpoint / name, out / name)
    return out


def test_serving_engines_with_ort_suggests_trt(engine_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(engine_dir), "--backend", "ort"]) == 2
    err = capsys.readouterr().err
    assert (
        f"ldlm serve: error: {engine_dir} holds TensorRT plans (decoder.plan, denoiser.plan, encoder.plan) written by "
        "`ldlm build-engine`, not an ONNX export (it has no manifest.json); serve it with --backend trt "
        "(parity, probe-eps and bench take it as --engine-dir), or give ONNX Runtime the export the plans were built from" in err
    ), err


def test_parity_given_engines_as_an_export_says_so(tiny_checkpoint: Path, engine_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["parity", str(tiny_checkpoint), "--onnx-dir", str(engine_dir), "--out", str(tmp_path / "r"), "--quiet"]) == 2
    assert f"{engine_dir} holds TensorRT plans (decoder.plan, denoiser.plan, encoder.plan)" in capsys.readouterr().err


def test_serving_an_export_with_trt_suggests_ort(export_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(export_dir), "--backend", "trt"]) == 2
    err = capsys.readouterr().err
    assert (
        f"ldlm serve: error: {export_dir} is an ONNX export written by `ldlm export` (it has a manifest.json), not TensorRT "
        f"plans; serve it with --backend ort, or build engines from it: ldlm build-engine {export_dir} ENGINE_DIR" in err
    ), err


def test_a_directory_of_neither_keeps_its_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{}")
    from ldlm.export.artifact import read_manifest

    with pytest.raises(ValueError, match=r"has no manifest\.json; is it a directory written by `ldlm export`\?"):
        read_manifest(tmp_path)
