"""INT8 and FP8 engines from calibrated Q/DQ graphs, built with TensorRT-RTX ahead of time (no GPU needed):
the plan's manifest says the precision and how it was calibrated, the parsed network holds real quantize
layers and every INormalizationLayer kept eps 1e-5 in float32, and a Q/DQ graph TensorRT refuses is
reported plainly with nothing left behind. Running the plans needs a GPU: not done here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

import ldlm.export.qdq as qdq
from ldlm.cli import main
from ldlm.export.artifact import read_plan_manifest
from ldlm.export.calibration import CalibrationSettings
from ldlm.export.engine_builder import BuildOptions, build_engines
from ldlm.export.layernorm.trt_network import parse_onnx_network, read_normalization_layers
from ldlm.export.layernorm.verify import VerificationError
from ldlm.export.profiles import EngineProfile, ShapeRange
from ldlm.export.trt_flavor import EngineBuildError, load_flavor

trt_rtx = pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install -e .[rtx]); no Q/DQ engine was built")
SMALL = (EngineProfile(ShapeRange(1, 2, 4), ShapeRange(1, 16, 64)),)
CALIBRATION = CalibrationSettings(samples=4, length=8)
QUANTIZED_TYPE = {"int8": "INT8", "fp8": "FP8"}


@pytest.fixture(scope="module", params=["int8", "fp8"])
def engines(request, export_dir: Path, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(f"qdq_engines_{request.param}") / "plans"
    if request.param == "int8":
        options = BuildOptions(precision="int8", profiles=SMALL, calibration_checkpoint=str(tiny_checkpoint), calibration=CALIBRATION)
        build_engines(export_dir, out, options, flavor="tensorrt_rtx")
    else:  # the same through the CLI
        profile = "batch=1:2:4,seq=1:16:64"
        calibration = ["--calibration-checkpoint", str(tiny_checkpoint), "--calibration-samples", "4", "--calibration-length", "8"]
        main(
            [
                "build-engine",
                str(export_dir),
                str(out),
                "--flavor",
                "tensorrt_rtx",
                "--precision",
                "fp8",
                "--profile",
                profile,
                *calibration,
                "--quiet",
            ]
        )
    return request.param, out


def test_the_plan_manifest_records_the_precision_and_the_calibration(engines) -> None:
    precision, out = engines
    for graph in ("encoder", "denoiser", "decoder"):
        assert (out / f"{graph}.plan").stat().st_size > 10_000
        manifest = read_plan_manifest(out / f"{graph}.plan")
        assert manifest["precision"] == precision and manifest["flavor"] == "tensorrt_rtx"
        assert manifest["onnx"]["file"] == f"{graph}.{precision}.onnx" and (out / f"{graph}.{precision}.onnx").is_file()
        quantization = manifest["quantization"]
        assert quantization["precision"] == precision and quantization["quantized_nodes"] > 0
        assert quantization["calibration"] == CALIBRATION.to_dict()
        # the denoiser: one feed per step of the default sampler (21 on tiny); encoder, decoder: one padded batch
        assert quantization["calibration_feeds"] == (21 if graph == "denoiser" else 1)
    assert not [p for p in out.parent.iterdir() if p.name != out.name]  # no temporary directory left


def test_every_normalization_layer_kept_eps_1e5_in_float32_beside_real_quantize_layers(engines) -> None:
    precision, out = engines
    flavor = load_flavor("tensorrt_rtx")
    trt = flavor.trt
    for graph, layer_norms in (("encoder", 6), ("denoiser", 0), ("decoder", 6)):
        path = out / f"{graph}.{precision}.onnx"  # the file the plan was built from (its sha256 is in the manifest)
        _, network, _ = parse_onnx_network(flavor, path)
        norms = read_normalization_layers(trt, network)
        assert len(norms) == layer_norms == sum(1 for n in onnx.load(str(path)).graph.node if n.op_type == "LayerNormalization")
        assert all(n.epsilon == float(np.float32(1e-5)) and n.input_dtype == "FLOAT" for n in norms)
        layers = [network.get_layer(i) for i in range(network.num_layers)]
        quantize = [layer for layer in layers if layer.type == trt.LayerType.QUANTIZE]
        assert quantize and all(q.get_output(0).dtype.name == QUANTIZED_TYPE[precision] for q in quantize)


def test_a_qdq_graph_tensorrt_rtx_refuses_is_reported_plainly_and_leaves_nothing(
    export_dir: Path, tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ONNX Runtime's int32 biases (``QuantizeBias``, here on the time projections' Gemms) are what TensorRT's
    parser refuses in a Q/DQ graph: made for real, so the refusal is TensorRT-RTX's own. Our verifier stops
    that graph first (an INT32 zero point); with that one check set aside, the graph reaches TensorRT-RTX."""
    import ldlm.export.layernorm.verify as verify

    monkeypatch.setattr(qdq, "QDQ_EXTRA_OPTIONS", {**qdq.QDQ_EXTRA_OPTIONS, "QuantizeBias": True})
    monkeypatch.setattr(qdq, "float_kept_nodes", lambda model: [])  # quantize the Gemms too: they carry the biases
    options = BuildOptions(precision="int8", profiles=SMALL, calibration_checkpoint=str(tiny_checkpoint), calibration=CALIBRATION)
    with pytest.raises(VerificationError, match=r"DequantizeLinear '[^']*time_proj[^']*': zero point type INT32; a int8 graph needs INT8"):
        build_engines(export_dir, tmp_path / "plans", options, graphs=["denoiser"], flavor="tensorrt_rtx")
    assert list(tmp_path.iterdir()) == []

    monkeypatch.setattr(verify, "check_precision_claim", lambda graph, precision: [])
    with pytest.raises(EngineBuildError) as error:
        build_engines(export_dir, tmp_path / "plans", options, graphs=["denoiser"], flavor="tensorrt_rtx")
    message = str(error.value)
    assert message.startswith(
        f"TensorRT-RTX {trt_rtx.__version__} (flavor tensorrt_rtx) refused the INT8 Q/DQ graph: full NVIDIA TensorRT on a GPU is "
        "needed (--flavor tensorrt on a GPU that runs INT8 from compute capability 7.5). TensorRT-RTX said: "
    ), message
    assert "input has type Int32 but must have type FP8, FP4, Int4, Int8, or UInt8" in message
    assert list(tmp_path.iterdir()) == []


def test_quantized_builds_without_a_calibration_checkpoint_or_with_another_are_refused(
    export_dir: Path, tiny_checkpoint: Path, tmp_path: Path, capsys
) -> None:
    with pytest.raises(ValueError, match=r"precision='fp8' needs calibration_checkpoint \(--calibration-checkpoint\)"):
        BuildOptions(precision="fp8")
    with pytest.raises(ValueError, match=r"precision='int4' is unsupported; allowed: fp32, fp16, bf16, int8, fp8"):
        BuildOptions(precision="int4")
    with pytest.raises(ValueError, match="calibration settings apply only to precision int8 or fp8; precision='fp16'"):
        BuildOptions(precision="fp16", calibration_checkpoint=str(tiny_checkpoint))
    with pytest.raises(SystemExit):
        main(["build-engine", str(export_dir), str(tmp_path / "plans"), "--precision", "int8", "--calibration-samples", "0"])
    assert "--calibration-samples: 0 is out of range; allowed: 1..256" in capsys.readouterr().err
    options = BuildOptions(precision="int8", profiles=SMALL, calibration_checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match="has no model.safetensors; allowed: the checkpoint the export was made from"):
        build_engines(export_dir, tmp_path / "plans", options, flavor="tensorrt_rtx")
    assert not (tmp_path / "plans").exists()
    assert json.loads((export_dir / "manifest.json").read_text())["graphs"]["denoiser"].get("variants") is None  # the export is untouched
