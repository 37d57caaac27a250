"""An export or an engine set records the sha256 of the checkpoint weights it was made from; parity and
probe-eps refuse one made from other weights (a comparison against them measured 0% agreement and
said nothing else), naming both hashes and the fix, before the checkpoint is loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ldlm.cli import main
from ldlm.export.artifact import MANIFEST_FILE, check_from_checkpoint, sha256_file
from ldlm.export.onnx_export import export_graphs
from ldlm.model.checkpoint import init_model, save_checkpoint


@pytest.fixture(scope="module")
def other_export(tiny_config, tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An export of another checkpoint with the same config (another seed): only the weights differ."""
    work = tmp_path_factory.mktemp("other")
    other = save_checkpoint(init_model(tiny_config, seed=1, norm_init="random"), tokenizer, work / "ckpt")
    return export_graphs(other, work / "onnx", graphs=("decoder",)).out


def weights_sha256(directory: Path) -> str:
    return sha256_file(directory / "model.safetensors")


def test_an_export_records_the_weights_it_was_made_from(tiny_checkpoint: Path, export_dir: Path) -> None:
    manifest = json.loads((export_dir / MANIFEST_FILE).read_text())
    assert manifest["checkpoint_weights_sha256"] == weights_sha256(tiny_checkpoint)
    check_from_checkpoint(tiny_checkpoint, export_dir)  # its own checkpoint: no complaint


@pytest.mark.parametrize("command", ["parity", "probe-eps"])
def test_an_export_of_another_checkpoint_is_refused(
    command: str, tiny_checkpoint: Path, other_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [command, str(tiny_checkpoint), "--onnx-dir", str(other_export), "--out", str(tmp_path / "report"), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    recorded = json.loads((other_export / MANIFEST_FILE).read_text())["checkpoint_weights_sha256"]
    assert (
        f"ldlm {command}: error: this export is not from this checkpoint: {other_export / MANIFEST_FILE} records weights "
        f"sha256 {recorded}, but {tiny_checkpoint / 'model.safetensors'} has sha256 {weights_sha256(tiny_checkpoint)}; "
        f"re-export it from this checkpoint: ldlm export {tiny_checkpoint} {other_export} --force" in err
    ), err
    assert recorded != weights_sha256(tiny_checkpoint)
    assert not (tmp_path / "report").exists()


def test_engines_of_another_checkpoint_are_refused(
    tiny_checkpoint: Path, other_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What `ldlm build-engine` writes beside each plan carries the export's record (no GPU needed: the
    check reads the plan manifests before any plan is loaded)."""
    engines = tmp_path / "engines"
    engines.mkdir()
    recorded = json.loads((other_export / MANIFEST_FILE).read_text())["checkpoint_weights_sha256"]
    (engines / "decoder.plan").write_bytes(b"plan")
    (engines / "decoder.plan.json").write_text(json.dumps({"ldlm_version": "0", "graph": "decoder", "checkpoint_weights_sha256": recorded}))
    for argv in (["parity", "--backend", "trt"], ["probe-eps"]):
        assert main([argv[0], str(tiny_checkpoint), *argv[1:], "--engine-dir", str(engines), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert (
            f"these engines are not from this checkpoint: {engines / 'decoder.plan.json'} records weights sha256 {recorded}, "
            f"but {tiny_checkpoint / 'model.safetensors'} has sha256 {weights_sha256(tiny_checkpoint)}; re-export and rebuild: "
            f"ldlm export {tiny_checkpoint} ONNX_DIR, then ldlm build-engine ONNX_DIR {engines} --force" in err
        ), err


def test_an_export_from_before_the_record_is_not_refused(tiny_checkpoint: Path, other_export: Path, tmp_path: Path) -> None:
    old = tmp_path / "old"
    shutil.copytree(other_export, old)
    manifest = json.loads((old / MANIFEST_FILE).read_text())
    del manifest["checkpoint_weights_sha256"]
    (old / MANIFEST_FILE).write_text(json.dumps(manifest))
    check_from_checkpoint(tiny_checkpoint, old)  # nothing to compare with: the other checks still run


def test_build_engine_carries_the_record_into_each_plan(other_export: Path, tmp_path: Path, capsys, tiny_checkpoint: Path) -> None:
    """A real build (TensorRT-RTX builds ahead of time without a GPU), then probe-eps refuses it."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install -e .[rtx]); no engine was built")
    from ldlm.export.engine_builder import BuildOptions, build_engines
    from ldlm.export.profiles import EngineProfile, ShapeRange

    small = BuildOptions(profiles=(EngineProfile(ShapeRange(1, 1, 2), ShapeRange(1, 8, 16)),))
    engines = build_engines(other_export, tmp_path / "engines", small, flavor="tensorrt_rtx").out
    recorded = json.loads((other_export / MANIFEST_FILE).read_text())["checkpoint_weights_sha256"]
    assert json.loads((engines / "decoder.plan.json").read_text())["checkpoint_weights_sha256"] == recorded
    assert main(["probe-eps", str(tiny_checkpoint), "--engine-dir", str(engines), "--quiet"]) == 2
    assert f"these engines are not from this checkpoint: {engines / 'decoder.plan.json'} records weights sha256 {recorded}" in (
        capsys.readouterr().err
    )
