"""The stages through the `ldlm` command line, each checked for its exit code and for what it wrote:
export, verify-onnx (0 on a good export, 1 on a broken one), build-engine, triton-repo, and a passing
parity. Tiny settings throughout (one graph, tiny profiles)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ldlm.cli import main
from tests.artifacts import ENCODER_LN, edited_export, set_eps


def run(argv: list[str]) -> int:
    """The exit status a shell would see (main returns it, or a stage raises SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)


def test_export_one_graph(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "onnx"
    assert run(["export", str(tiny_checkpoint), str(out), "--graphs", "decoder", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "PASSED decoder: 6 LayerNormalization node(s), 6 expected" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(manifest["graphs"]) == ["decoder"] and (out / "decoder.onnx").is_file()
    assert run(["export", str(tiny_checkpoint), str(out), "--graphs", "decoder", "--quiet"]) == 2  # exists: needs --force
    assert "--force" in capsys.readouterr().err


def test_verify_onnx_exit_codes(export_dir: Path, tmp_path: Path, capsys) -> None:
    assert run(["verify-onnx", str(export_dir), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["graph"] for r in results] == ["encoder", "denoiser", "decoder"] and all(r["passed"] for r in results)

    # Resealed, so past the sha256 check: the structural check must catch it.
    broken = edited_export(export_dir, tmp_path / "broken", "encoder", set_eps(ENCODER_LN, 1e-3))
    assert run(["verify-onnx", str(broken)]) == 1
    out = capsys.readouterr().out
    assert "FAILED encoder" in out and "epsilon 0.001 != module eps 1e-05" in out
    assert "PASSED decoder" in out


def test_build_engine_one_graph(export_dir: Path, tmp_path: Path, capsys) -> None:
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX builds the plan (pip install -e .[rtx])")
    out = tmp_path / "engines"
    code = run(
        [
            "build-engine",
            str(export_dir),
            str(out),
            "--flavor",
            "tensorrt_rtx",
            "--graphs",
            "decoder",
            "--profile",
            "batch=1:1:2,seq=1:8:16",
            "--quiet",
        ]
    )
    assert code == 0
    manifest = json.loads((out / "decoder.plan.json").read_text())
    assert manifest["profiles"] == [{"batch": [1, 1, 2], "seq": [1, 8, 16]}] and manifest["layer_norms"] == 6
    assert (out / "decoder.plan").stat().st_size > 10_000
    assert "decoder: decoder.plan (tensorrt_rtx" in capsys.readouterr().out
    assert run(["build-engine", str(export_dir), str(tmp_path / "bad"), "--profile", "batch=4:2:8,seq=1:2:3", "--quiet"]) == 2
    assert "batch profile 4:2:8 is invalid" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_triton_repo(export_dir: Path, tmp_path: Path, capsys) -> None:
    pytest.importorskip("tritonclient.grpc", reason="config.pbtxt is validated with tritonclient's schema")
    out = tmp_path / "repo"
    assert run(["triton-repo", str(export_dir), str(out), "--cpu", "--max-batch", "4"]) == 0
    printed = capsys.readouterr().out
    assert "models decoder, denoiser, encoder, ldlm_generate" in printed
    # KIND_CPU instances: the docker hint asks for no GPU (it said --gpus all whatever --cpu said)
    assert "run: docker run --rm -p8000:8000" in printed and "--gpus" not in printed
    # ldlm_generate imports ldlm: the printed line installs the wheel it names, which a line above says how to build
    assert f"-v {Path('dist').resolve()}:/wheels" in printed and "pip install /wheels/ldlm-*.whl && tritonserver" in printed
    assert "pip wheel --no-deps -w dist ." in printed
    assert run(["triton-repo", str(export_dir), str(tmp_path / "gpu"), "--max-batch", "4"]) == 0
    assert "run: docker run --gpus all --rm" in capsys.readouterr().out
    assert "max_batch_size: 4" in (out / "encoder" / "config.pbtxt").read_text()
    assert run(["triton-repo", str(export_dir), str(tmp_path / "r2"), "--cc-plan", "nonsense"]) == 2
    assert "--cc-plan 'nonsense' is malformed" in capsys.readouterr().err


def test_parity_passes_through_the_cli(tiny_checkpoint: Path, export_dir: Path, tmp_path: Path, capsys) -> None:
    pytest.importorskip("onnxruntime", reason="ONNX Runtime is the engine under test (pip install -e .[cpu])")
    out = tmp_path / "parity"
    assert run(["parity", str(tiny_checkpoint), "--onnx-dir", str(export_dir), "--steps", "2", "--quiet", "--out", str(out)]) == 0
    assert "PASSED parity ort (fp32) vs eager" in capsys.readouterr().out
    report = json.loads((out / "parity.json").read_text())
    assert report["passed"] is True and report["token_agreement"] == 1.0
    assert all(v == 1.0 for v in report["decoder_token_agreement"].values())
