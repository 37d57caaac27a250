"""Configs bounded at load, and export directories trusted only after their
manifest checks out (paths inside, sha256 of every file) in every consumer: verify-onnx, serve,
parity, build-engine's reader; load errors named; leftovers of a killed export removed."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ldlm.export.artifact import ArtifactError
from ldlm.export.layernorm.verify import VerificationError
from ldlm.export.onnx_export import verify_export
from ldlm.files import atomic_directory
from ldlm.model.config import FLOAT_RANGES, INT_RANGES, LDLMConfig, preset
from ldlm.serve.runtime.backends import open_graphs
from ldlm.serve.runtime.graph_backend import BackendError
from tests.artifacts import reseal_manifest

# Only the artifact tests that open an export need ONNX Runtime; the config bounds and the clean-up
# of a killed writer's leftovers run without it.
needs_ort = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime") is None, reason="the export is opened with ONNX Runtime (pip install -e .[cpu])"
)


# --- 6. config bounds ---------------------------------------------------------------------------


def test_a_billion_layers_is_refused_at_load(tmp_path: Path) -> None:
    data = preset("tiny").to_dict() | {"denoiser_layers": 1_000_000_000}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"denoiser_layers=1000000000 is invalid; allowed: an integer in 2\.\.256"):
        LDLMConfig.load(tmp_path / "config.json")


@pytest.mark.parametrize("field", sorted(INT_RANGES))
def test_every_integer_field_has_a_range(field: str) -> None:
    low, high = INT_RANGES[field]
    for bad in (high + 1, low - 1, True if low > 1 else 1.5):
        with pytest.raises(ValueError, match=f"config field {field}="):
            dataclasses.replace(preset("tiny"), **{field: bad})


@pytest.mark.parametrize("field", sorted(FLOAT_RANGES))
def test_every_float_field_has_a_range(field: str) -> None:
    low, high = FLOAT_RANGES[field]
    for bad in (high * 10, low, -1.0, float("nan"), float("inf"), "1e-5"):
        with pytest.raises(ValueError, match=f"config field {field}="):
            dataclasses.replace(preset("tiny"), **{field: bad})


def test_other_fields_reject_wrong_types() -> None:
    for field, bad in (("per_stream_kv", "yes"), ("eos_token_id", 1.0), ("t_min", float("nan")), ("feature_layer", None)):
        with pytest.raises(ValueError, match=f"config field {field}="):
            dataclasses.replace(preset("tiny"), **{field: bad})
    assert dataclasses.replace(preset("base"), denoiser_layers=256).denoiser_layers == 256  # the top of the range is allowed


# --- 7. artifacts ---------------------------------------------------------------------------------


@pytest.fixture()
def export_copy(export_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "onnx"
    shutil.copytree(export_dir, out)
    return out


def edit_manifest(directory: Path, edit) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    edit(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


@needs_ort
@pytest.mark.parametrize("path", ["../../../../etc/passwd", "/etc/passwd", "sub/../../outside.onnx"])
def test_manifest_paths_must_stay_inside(export_copy: Path, path: str) -> None:
    edit_manifest(export_copy, lambda m: m["graphs"]["encoder"]["files"].update({path: {"sha256": "0" * 64}}))
    for consumer in (lambda: open_graphs("ort", export_copy), lambda: verify_export(export_copy)):
        with pytest.raises(ArtifactError, match="absolute path|leaves the directory"):
            consumer()
    edit_manifest(export_copy, lambda m: m["graphs"]["encoder"].update({"file": path}))
    with pytest.raises(ArtifactError, match="absolute path|leaves the directory"):
        open_graphs("ort", export_copy)


@needs_ort
def test_symlink_out_of_the_directory_is_refused(export_copy: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.onnx.data"
    shutil.move(export_copy / "encoder.onnx.data", outside)
    (export_copy / "encoder.onnx.data").symlink_to(outside)
    with pytest.raises(ArtifactError, match="leaves the directory"):
        open_graphs("ort", export_copy)


@needs_ort
def test_the_tokenizer_is_trusted_only_with_its_sha256(export_copy: Path) -> None:
    """A server decodes every text with tokenizer.json: an edited one would change every answer."""
    record = json.loads((export_copy / "manifest.json").read_text())["tokenizer"]
    assert record == {
        "file": "tokenizer.json",
        "sha256": hashlib.sha256((export_copy / "tokenizer.json").read_bytes()).hexdigest(),
        "bytes": (export_copy / "tokenizer.json").stat().st_size,
    }
    open_graphs("ort", export_copy)  # as exported: trusted
    text = (export_copy / "tokenizer.json").read_text()
    (export_copy / "tokenizer.json").write_text(text.replace('"the"', '"thE"', 1))
    with pytest.raises(ArtifactError, match=r"tokenizer\.json (is \d+ bytes|does not match the sha256)"):
        open_graphs("ort", export_copy)
    with pytest.raises(ArtifactError, match=r"tokenizer\.json (is \d+ bytes|does not match the sha256)"):
        verify_export(export_copy)
    edit_manifest(export_copy, lambda m: m.pop("tokenizer"))  # an export from before tokenizers were hashed
    with pytest.raises(ArtifactError, match=r"tokenizer\.json has no sha256 in .*manifest\.json, so it is not trusted"):
        open_graphs("ort", export_copy)
    (export_copy / "tokenizer.json").unlink()
    open_graphs("ort", export_copy)  # no tokenizer file, no record: GPT-2's built-in tokenizer, nothing to trust
    edit_manifest(export_copy, lambda m: m.update(tokenizer=record))
    with pytest.raises(ArtifactError, match=r"tokenizer\.json is listed in .* but missing"):
        open_graphs("ort", export_copy)


@needs_ort
def test_edited_weight_bytes_are_refused_by_every_consumer(export_copy: Path, tiny_checkpoint: Path) -> None:
    data = bytearray((export_copy / "encoder.onnx.data").read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight
    (export_copy / "encoder.onnx.data").write_bytes(bytes(data))
    message = r"encoder\.onnx\.data does not match the sha256"
    with pytest.raises(ArtifactError, match=message):
        verify_export(export_copy)
    with pytest.raises(ArtifactError, match=message):
        open_graphs("ort", export_copy)
    from ldlm.serve.api.service import LDLMService, ServerSettings
    from ldlm.serve.checks.parity import run_parity

    with pytest.raises(ArtifactError, match=message):
        LDLMService(str(export_copy), ServerSettings())
    with pytest.raises(ArtifactError, match=message):
        run_parity(tiny_checkpoint, "ort", source=export_copy)
    result = subprocess.run(
        [sys.executable, "-m", "ldlm.cli", "verify-onnx", str(export_copy)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0 and "does not match the sha256" in result.stderr and "Traceback" not in result.stderr


@needs_ort
def test_edited_config_is_refused(export_copy: Path) -> None:
    config = json.loads((export_copy / "config.json").read_text()) | {"t_min": 0.2}
    (export_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match="config.json does not match the config_sha256"):
        open_graphs("ort", export_copy)


@needs_ort
def test_external_data_outside_the_manifest_is_refused(export_copy: Path) -> None:
    import onnx

    model = onnx.load(str(export_copy / "encoder.onnx"), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.external_data)
    next(e for e in tensor.external_data if e.key == "location").value = "../../../../etc/passwd"
    onnx.save(model, str(export_copy / "encoder.onnx"))
    reseal_manifest(export_copy, "encoder")
    with pytest.raises(ArtifactError, match="leaves the directory"):
        open_graphs("ort", export_copy)


@needs_ort
def test_onnx_runtime_load_errors_name_the_file(export_copy: Path) -> None:
    import onnx

    model = onnx.load(str(export_copy / "encoder.onnx"), load_external_data=False)
    model.graph.node[len(model.graph.node) // 2].op_type = "NoSuchOperator"
    onnx.save(model, str(export_copy / "encoder.onnx"))
    reseal_manifest(export_copy, "encoder")
    with pytest.raises(VerificationError, match=r"encoder\.onnx: FAILED encoder: .*\n  - onnx\.checker full check failed: "):
        open_graphs("ort", export_copy)  # the verifier refuses it before ONNX Runtime is asked
    from ldlm.serve.runtime.ort_backend import OrtBackend  # ONNX Runtime's module, for the runtime's own message

    with pytest.raises(BackendError, match=r"ONNX Runtime cannot load .*encoder\.onnx: "):
        OrtBackend(export_copy / "encoder.onnx", "encoder", preset("tiny").max_seq_len)


def test_leftovers_of_a_killed_writer_are_removed(tmp_path: Path) -> None:
    out = tmp_path / "onnx"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    killed = tmp_path / f".onnx.{dead.pid}.k1ll3d.tmp"  # a writer that is gone
    killed.mkdir()
    (killed / "encoder.onnx").write_bytes(b"half")
    running = tmp_path / f".onnx.{os.getpid()}.l1ve.tmp"  # a writer still at work (this process)
    running.mkdir()
    old_style = tmp_path / ".onnx.abcd1234.tmp"  # from before PIDs were in the name
    old_style.mkdir()
    other = tmp_path / ".other.1.x.tmp"  # another target's: not ours to touch
    other.mkdir()
    with atomic_directory(out) as tmp:
        (tmp / "done").write_text("ok")
    assert not killed.exists() and not old_style.exists()
    assert running.exists() and other.exists() and (out / "done").read_text() == "ok"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f".onnx.{os.getpid()}.l1ve.tmp", ".other.1.x.tmp", "onnx"])
