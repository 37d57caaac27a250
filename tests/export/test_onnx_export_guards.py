"""Guards of the export side that no other test triggers, each with the message a user sees: the
manifest's trust checks (export/artifact.py), export, verify, precision, profiles, engine options,
the TensorRT flavour, and the Triton repository writer's inputs."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from ldlm.export.artifact import ArtifactError, check_artifacts, check_engine_dir, check_file, check_tokenizer
from ldlm.export.layernorm.verify import VerificationError, VerifyResult, verify_all
from ldlm.model.checkpoint import init_model, save_checkpoint
from ldlm.model.config import preset


def raises(error: type[Exception], message: str):
    return pytest.raises(error, match=re.escape(message))


# --- the manifest's trust checks ------------------------------------------------------------------


def test_manifest_structure_is_checked_before_any_file(tmp_path: Path) -> None:
    where = tmp_path / "manifest.json"
    for manifest in ({}, {"graphs": {}}, {"graphs": []}):
        with raises(ArtifactError, f"{where} lists no graphs; re-export with `ldlm export`"):
            check_artifacts(tmp_path, manifest)
    for entry in ("encoder.onnx", {"file": "encoder.onnx"}, {"file": "encoder.onnx", "files": ["encoder.onnx"]}):
        with raises(ArtifactError, f"{where}: graph 'encoder' has no 'files' with sha256 sums"):
            check_artifacts(tmp_path, {"graphs": {"encoder": entry}})
    for name in (None, "", 3):
        with raises(ArtifactError, f"{where}: file entry {name!r} is invalid; allowed: a relative path inside {tmp_path}"):
            check_artifacts(tmp_path, {"graphs": {"encoder": {"file": name, "files": {}}}})
    with raises(ArtifactError, f"{where}: graph 'encoder' file 'encoder.onnx' has no sha256 entry"):
        check_artifacts(tmp_path, {"graphs": {"encoder": {"file": "encoder.onnx", "files": {"encoder.onnx.data": {}}}}})


def test_each_file_record_needs_its_sha256_and_size(tmp_path: Path) -> None:
    from ldlm.export.artifact import sha256_file

    (tmp_path / "w.bin").write_bytes(b"12345")
    for record in (None, {}, {"sha256": 5}, "abc"):
        with raises(ArtifactError, f"{tmp_path / 'manifest.json'}: 'w.bin' has no sha256; re-export with `ldlm export`"):
            check_file(tmp_path, "w.bin", record)
    digest = sha256_file(tmp_path / "w.bin")
    check_file(tmp_path, "w.bin", {"sha256": digest, "bytes": 5})  # the true record passes
    with raises(ArtifactError, f"{tmp_path / 'w.bin'} is 5 bytes; its manifest says 6 (edited or truncated); re-export it"):
        check_file(tmp_path, "w.bin", {"sha256": digest, "bytes": 6})
    with raises(ArtifactError, f"{tmp_path / 'missing.bin'} is listed in {tmp_path / 'manifest.json'} but missing"):
        check_file(tmp_path, "missing.bin", {"sha256": digest})


def test_tokenizer_record_must_name_the_tokenizer_file(tmp_path: Path) -> None:
    for record in ({"file": "vocab.json", "sha256": "0" * 64}, "tokenizer.json", {"sha256": "0" * 64}):
        with raises(
            ArtifactError,
            f"{tmp_path / 'manifest.json'}: tokenizer entry {record!r} is invalid; allowed: {{'file': 'tokenizer.json', 'sha256': ...}}",
        ):
            check_tokenizer(tmp_path, record)
    check_tokenizer(tmp_path, None)  # no record and no file: GPT-2's built-in tokenizer, nothing to check


def test_weights_file_missing_from_the_manifest_is_refused(export_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "onnx"
    shutil.copytree(export_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["graphs"]["denoiser"]["files"]["denoiser.onnx.data"]  # the weights file, no longer hashed
    with pytest.raises(
        ArtifactError,
        match=re.escape(f"{copy / 'denoiser.onnx'} reads tensor ")
        + r"'[^']+'"
        + re.escape(" from 'denoiser.onnx.data', which " + f"{copy / 'manifest.json'} does not list; re-export it"),
    ):
        check_artifacts(copy, manifest)


def test_engine_directory_needs_every_plan_with_its_record(tmp_path: Path) -> None:
    with raises(ArtifactError, f"{tmp_path} has no encoder.plan with its encoder.plan.json; build it with `ldlm build-engine`"):
        check_engine_dir(tmp_path, ["encoder"])
    (tmp_path / "encoder.plan").write_bytes(b"plan")
    with raises(ArtifactError, f"{tmp_path} has no encoder.plan with its encoder.plan.json"):
        check_engine_dir(tmp_path, ["encoder"])  # the plan alone is not enough


# --- export, verify, precision, profiles ------------------------------------------------------------


def test_export_inputs_are_named(export_dir: Path, tmp_path: Path, tiny_model) -> None:
    from ldlm.export.artifact import read_manifest
    from ldlm.export.graphs import graph_io
    from ldlm.export.onnx_export import verify_export

    with raises(ValueError, f"{tmp_path} has no manifest.json; is it a directory written by `ldlm export`?"):
        read_manifest(tmp_path)
    with raises(ValueError, f"{tmp_path / 'nowhere'} does not exist; allowed: a directory written by `ldlm export`"):
        verify_export(tmp_path / "nowhere")
    copy = tmp_path / "onnx"
    shutil.copytree(export_dir, copy)
    (copy / "extra.onnx").write_bytes(b"")
    with raises(ValueError, f"extra.onnx is not listed in {copy / 'manifest.json'}"):
        verify_export(copy / "extra.onnx")
    other = save_checkpoint(init_model(dataclasses.replace(preset("tiny"), t_min=0.1), seed=0), _tokenizer(), tmp_path / "other")
    with raises(ValueError, f"checkpoint {other} has another config than the export (config_sha256 differs)"):
        verify_export(copy, other)
    with raises(ValueError, "unknown graph 'vae'; allowed: encoder, denoiser, decoder"):
        graph_io(tiny_model, "vae")


def _tokenizer():
    from ldlm.model.tokenizer import TextTokenizer

    return TextTokenizer.gpt2()


def test_precision_profiles_and_engine_options(export_dir: Path, tmp_path: Path) -> None:
    from ldlm.export.engine_builder import BuildOptions, build_engines
    from ldlm.export.precision import lower_precision
    from ldlm.export.profiles import EngineProfile, ShapeRange, profile_shapes

    with raises(ValueError, "precision='int8' has no cast pass; allowed: fp16, bf16"):
        lower_precision(export_dir / "encoder.onnx", tmp_path / "x.onnx", "int8")
    profile = EngineProfile(ShapeRange(1, 2, 4), ShapeRange(1, 8, 16))
    assert profile_shapes([{"name": "x", "shape": ["batch", "seq", 64]}], profile) == {"x": ((1, 1, 64), (2, 8, 64), (4, 16, 64))}
    with raises(ValueError, "input x has symbolic axes ['chan']; profiles know batch and seq"):
        profile_shapes([{"name": "x", "shape": ["batch", "chan"]}], profile)
    assert BuildOptions(workspace_mb=1).workspace_mb == 1
    with raises(ValueError, "workspace_mb=0 is out of range; allowed: >= 1"):
        BuildOptions(workspace_mb=0)
    with raises(ValueError, f"graphs ['vae'] are not in {export_dir}; allowed: encoder, denoiser, decoder"):
        build_engines(export_dir, tmp_path / "plans", graphs=["encoder", "vae"])
    assert not (tmp_path / "plans").exists()


def test_a_missing_tensorrt_flavour_is_named() -> None:
    import importlib.util

    from ldlm.export.trt_flavor import FlavorError, load_flavor

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("NVIDIA TensorRT is installed here: the not-installed message cannot be provoked")
    with pytest.raises(
        FlavorError, match=r"TensorRT flavour 'tensorrt' is not installed \(tensorrt: No module named 'tensorrt'\); install it"
    ):
        load_flavor("tensorrt")
    with raises(FlavorError, "flavor='trt' is unknown; allowed: tensorrt, tensorrt_rtx"):
        load_flavor("trt")


def test_verification_failures_name_every_failing_graph() -> None:
    ok = VerifyResult("encoder", "e.onnx", 2, 2, [])
    bad = VerifyResult("decoder", "d.onnx", 3, 2, ["3 LayerNormalization nodes, 2 modules"])
    ok.raise_for_problems()
    assert verify_all([ok]) == [ok]
    with raises(
        VerificationError, "d.onnx: FAILED decoder: 3 LayerNormalization node(s), 2 expected\n  - 3 LayerNormalization nodes, 2 modules"
    ):
        bad.raise_for_problems()
    with pytest.raises(VerificationError) as error:
        verify_all([ok, bad, dataclasses.replace(bad, graph="denoiser", path="n.onnx")])
    assert str(error.value).splitlines()[0] == "d.onnx: FAILED decoder: 3 LayerNormalization node(s), 2 expected"
    assert "n.onnx: FAILED denoiser" in str(error.value) and "e.onnx" not in str(error.value)


# --- the Triton repository writer's inputs ------------------------------------------------------------


def test_triton_repository_inputs(export_dir: Path, tmp_path: Path) -> None:
    from ldlm.serve.deploy.triton_repo import RepositoryError, write_triton_repo

    out = tmp_path / "repo"
    with raises(RepositoryError, f"{tmp_path / 'nope'} is not a directory; allowed: an `ldlm export` or `ldlm build-engine` directory"):
        write_triton_repo(tmp_path / "nope", out)
    for name, value, allowed in (
        ("max_batch", 0, "1..65536"),
        ("max_batch", 65537, "1..65536"),
        ("max_n", 0, "1..65536"),
        ("max_n", 65537, "1..65536"),
    ):
        with raises(RepositoryError, f"{name}={value} is out of range; allowed: {allowed}"):
            write_triton_repo(export_dir, out, **{name: value})
    with raises(RepositoryError, "cc_model_filenames need engine directories; the source is an ONNX export"):
        write_triton_repo(export_dir, out, cc_plans={"8.6": str(tmp_path)})
    partial = tmp_path / "partial"
    partial.mkdir()
    manifest = json.loads((export_dir / "manifest.json").read_text())
    del manifest["graphs"]["decoder"]
    (partial / "manifest.json").write_text(json.dumps(manifest))
    with raises(RepositoryError, f"{partial} has no decoder graph(s); export all three"):
        write_triton_repo(partial, out)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for graph, precision in (("encoder", "fp32"), ("denoiser", "fp16"), ("decoder", "fp32")):
        (mixed / f"{graph}.plan").write_bytes(b"plan")
        (mixed / f"{graph}.plan.json").write_text(json.dumps({"flavor": "tensorrt_rtx", "trt_version": "1.2", "precision": precision}))
    with raises(
        RepositoryError,
        f"{mixed} is mixed: its plans come from different builds [('tensorrt_rtx', '1.2', 'fp16'), ('tensorrt_rtx', '1.2', 'fp32')]",
    ):
        write_triton_repo(mixed, out)
    assert not out.exists()


def test_triton_config_validation_names_what_differs(monkeypatch) -> None:
    pytest.importorskip("tritonclient.grpc", reason="config.pbtxt is validated with tritonclient's schema (pip install -e .[test])")
    from ldlm.serve.deploy.triton_repo import RepositoryError, validate_config

    io = {
        "inputs": [{"name": "x", "dtype": "FLOAT", "shape": ["batch", 4]}],
        "outputs": [{"name": "y", "dtype": "INT64", "shape": ["batch"]}],
    }
    good = (
        'name: "m"\nmax_batch_size: 8\ninput [{ name: "x" data_type: TYPE_FP32 dims: [4] }]\n'
        'output [{ name: "y" data_type: TYPE_INT64 dims: [1] reshape: { shape: [] } }]\n'
    )
    assert validate_config(good, io, "m/config.pbtxt").max_batch_size == 8
    with raises(RepositoryError, "m/config.pbtxt: input names ['z'] != graph's ['x']"):
        validate_config(good.replace('name: "x"', 'name: "z"'), io, "m/config.pbtxt")
    with raises(RepositoryError, "m/config.pbtxt: input x is 12/[4], the graph has FLOAT/[4]"):
        validate_config(good.replace("TYPE_FP32", "TYPE_FP64"), io, "m/config.pbtxt")  # TYPE_FP64 is 12
    with raises(RepositoryError, "m/config.pbtxt: config.pbtxt does not parse as ModelConfig"):
        validate_config("name: 3 3", io, "m/config.pbtxt")
    monkeypatch.setitem(__import__("sys").modules, "tritonclient.grpc", None)  # as without tritonclient[grpc]
    with raises(RepositoryError, "validating config.pbtxt needs tritonclient's model_config schema: pip install 'tritonclient[grpc]'"):
        validate_config(good, io, "m/config.pbtxt")


def test_tensorrt_logger_keeps_bounded_histories() -> None:
    """A capture keeps at most CAPTURE_LIMIT messages, the logger its last LOG_HISTORY; messages below
    WARNING are dropped (lower severity value = more severe). A stand-in for TensorRT's ILogger."""
    import types

    from ldlm.export.trt_flavor import CAPTURE_LIMIT, LOG_HISTORY, _make_logger

    class Level(int):
        def __str__(self) -> str:
            return {1: "Severity.ERROR", 2: "Severity.WARNING", 3: "Severity.INFO"}[int(self)]

    class ILogger:
        Severity = types.SimpleNamespace(ERROR=Level(1), WARNING=Level(2), INFO=Level(3))

        def __init__(self) -> None:
            pass

    logger = _make_logger(types.SimpleNamespace(ILogger=ILogger))
    with logger.capture() as messages:
        for i in range(CAPTURE_LIMIT + 5):
            logger.log(ILogger.Severity.WARNING, f"w{i}")
        logger.log(ILogger.Severity.INFO, "chatter")
    assert len(messages) == CAPTURE_LIMIT and messages[0] == ("WARNING", "w0") and messages[-1] == ("WARNING", f"w{CAPTURE_LIMIT - 1}")
    assert len(logger.messages) == LOG_HISTORY and logger.messages[-1] == ("WARNING", f"w{CAPTURE_LIMIT + 4}")
    logger.log(ILogger.Severity.ERROR, "after")
    assert len(messages) == CAPTURE_LIMIT and logger.messages[-1] == ("ERROR", "after")  # the capture has ended
