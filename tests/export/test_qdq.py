"""Explicit Q/DQ graphs (INT8, FP8 E4M3) calibrated on the pipeline's inputs: every norm outside every Q/DQ
pair (the verifier, naming the node), the float modules float, symmetric zero points, outputs close to fp32
on ONNX Runtime CPU, and bad input refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ldlm.export.artifact import read_manifest
from ldlm.export.calibration import CalibrationSettings, FeedReader, calibration_reader, denoiser_feeds
from ldlm.export.layernorm.verify import LayerNormSpec, verify_onnx
from ldlm.export.layernorm.verify_quantized import check_precision_claim, check_quantized_layer_norms, check_quantized_rms_norms
from ldlm.export.qdq import QdqError, write_qdq
from ldlm.export.quantize import float_kept_nodes
from ldlm.pipeline import LDLMPipeline

ort = pytest.importorskip("onnxruntime")
SMALL = CalibrationSettings(samples=4, length=8)
ZERO_POINT = {"int8": TensorProto.INT8, "fp8": TensorProto.FLOAT8E4M3FN}
# cosine of the Q/DQ denoiser's x0_hat with fp32's, per sample, on a held-out trajectory (seed 7, 8 x 16, all 21
# steps) on ONNX Runtime CPU. Measured on tiny: int8 min 0.99996, fp8 min 0.9993; the bounds leave room for hosts.
MIN_DENOISER_COSINE = {"int8": 0.9995, "fp8": 0.998}


@pytest.fixture(scope="module", params=["int8", "fp8"])
def qdq(request, export_dir: Path, pipeline: LDLMPipeline, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(f"qdq_{request.param}")
    for graph in ("denoiser", "decoder"):
        write_qdq(export_dir / f"{graph}.onnx", out / f"{graph}.onnx", request.param, calibration_reader(pipeline, graph, SMALL))
    return request.param, out


def specs_of(export_dir: Path, graph: str) -> list[LayerNormSpec]:
    return [LayerNormSpec.from_dict(d) for d in read_manifest(export_dir)["graphs"][graph]["layer_norms"]]


def test_the_qdq_decoder_keeps_every_layer_norm_and_passes_the_verifier(qdq, export_dir: Path) -> None:
    precision, out = qdq
    model = onnx.load(str(out / "decoder.onnx"))
    layer_norms = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    assert len(layer_norms) == 6
    for node in layer_norms:
        eps = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "epsilon")
        assert np.float32(eps) == np.float32(1e-5)
    for graph in ("denoiser", "decoder"):
        result = verify_onnx(out / f"{graph}.onnx", specs_of(export_dir, graph), graph, precision)
        assert result.passed, result.summary()


def test_matmul_weights_are_quantized_per_channel_symmetric_and_the_float_modules_are_not(qdq, export_dir: Path) -> None:
    precision, out = qdq
    for graph in ("denoiser", "decoder"):
        model = onnx.load(str(out / f"{graph}.onnx"))
        producer = {o: n for n in model.graph.node for o in n.output}
        constants = {i.name: i for i in model.graph.initializer}
        # MatMuls whose second input is a weight dequantized from a stored 8-bit constant (not attention's activations)
        weights = [
            n
            for n in model.graph.node
            if n.op_type in ("MatMul", "Gemm")
            and producer.get(n.input[1], n).op_type == "DequantizeLinear"
            and producer[n.input[1]].input[0] in constants
        ]
        assert len(weights) >= 5
        for node in weights:
            weight_dq = producer[node.input[1]]
            scale, zero_point = constants[weight_dq.input[1]], constants[weight_dq.input[2]]
            assert len(scale.dims) == 1 and scale.dims[0] > 1  # one scale per output channel
            assert zero_point.data_type == ZERO_POINT[precision] and not numpy_helper.to_array(zero_point).astype(np.float32).any()
        # named in the fp32 graph (torch.onnx's module scopes; the fp8 graph's opset upgrade drops that metadata)
        kept = set(float_kept_nodes(onnx.load(str(export_dir / f"{graph}.onnx"), load_external_data=False)))
        float_nodes = [n for n in model.graph.node if n.name in kept]
        assert len(float_nodes) == len(kept) > 0  # the denoiser's time embedding, the decoder's vocabulary head
        assert all(producer.get(i) is None or producer[i].op_type != "DequantizeLinear" for n in float_nodes for i in n.input)


def test_the_qdq_denoiser_stays_close_to_fp32_on_onnx_runtime(qdq, export_dir: Path, pipeline: LDLMPipeline) -> None:
    precision, out = qdq
    fp32 = ort.InferenceSession(str(export_dir / "denoiser.onnx"), providers=["CPUExecutionProvider"])
    quantized = ort.InferenceSession(str(out / "denoiser.onnx"), providers=["CPUExecutionProvider"])
    cosines, max_abs = [], 0.0
    for feed in denoiser_feeds(pipeline, CalibrationSettings(samples=8, length=16, seed=7))[0]:  # held out: another seed
        a, b = fp32.run(None, feed)[0], quantized.run(None, feed)[0]
        cosines += [float(u.ravel() @ v.ravel() / np.linalg.norm(u) / np.linalg.norm(v)) for u, v in zip(a, b)]
        max_abs = max(max_abs, float(np.abs(a - b).max()))
    assert min(cosines) >= MIN_DENOISER_COSINE[precision], (min(cosines), max_abs)
    assert max_abs > 1e-3  # another computation (8-bit inputs to every MatMul), in the same direction


def test_the_verifier_names_a_qdq_pair_on_an_rms_norm() -> None:
    """Pow -> ReduceMean -> Add(eps) -> Sqrt -> Div -> Mul(scale), as torch.onnx writes RMSNorm, fed by a DequantizeLinear."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["x"], name="dq_x"),
        helper.make_node("Pow", ["x", "two"], ["sq"], name="pow"),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], name="mean", keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"], name="add_eps"),
        helper.make_node("Sqrt", ["mse"], ["rms"], name="sqrt"),
        helper.make_node("Div", ["x", "rms"], ["xn"], name="div"),
        helper.make_node("Mul", ["xn", "w"], ["y"], name="scale"),
    ]
    inits = [
        helper.make_tensor("s", f, [], [0.1]),
        helper.make_tensor("zp", TensorProto.INT8, [], [0]),
        helper.make_tensor("two", f, [], [2.0]),
        helper.make_tensor("axes", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("eps", f, [], [1e-5]),
        helper.make_tensor("w", f, [4], [1.0] * 4),
    ]
    graph = helper.make_graph(
        nodes,
        "rms",
        [helper.make_tensor_value_info("xq", TensorProto.INT8, [2, 4])],
        [helper.make_tensor_value_info("y", f, [2, 4])],
        inits,
    )
    problems = check_quantized_rms_norms(graph)
    assert "RMSNorm Pow 'pow': its input 'x' comes from DequantizeLinear 'dq_x' (a Q/DQ pair on an RMSNorm)" in problems
    assert "RMSNorm Div 'div': its input 'x' comes from DequantizeLinear 'dq_x' (a Q/DQ pair on an RMSNorm)" in problems
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    assert set(problems) <= set(check_quantized_layer_norms(model))  # part of the check every graph passes
    nodes[0] = helper.make_node("Identity", ["xf"], ["x"], name="float_x")  # the same norm on a float input: clean
    clean = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info("xf", f, [2, 4])], graph.output, inits)
    assert check_quantized_rms_norms(clean) == []


def test_asymmetric_or_uint8_qdq_claimed_as_int8_is_refused_naming_the_node(
    export_dir: Path, pipeline: LDLMPipeline, tmp_path: Path
) -> None:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    def quantized(name: str, **options: object) -> onnx.GraphProto:
        path = tmp_path / f"decoder.{name}.onnx"
        reader = calibration_reader(pipeline, "decoder", SMALL)
        quantize_static(
            str(export_dir / "decoder.onnx"), str(path), reader, quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"], **options
        )
        return onnx.load(str(path)).graph

    asymmetric = quantized("asym")  # ONNX Runtime's default: int8 activations with a calibrated (nonzero) zero point
    problems = check_precision_claim(asymmetric, "int8")
    assert "nonzero zero point; TensorRT supports only symmetric quantization (zero point 0)" in problems[0], problems[:2]
    assert problems[0].startswith(("QuantizeLinear '", "DequantizeLinear '"))
    uint8 = quantized("u8", activation_type=QuantType.QUInt8)
    first = next(n for n in uint8.node if n.op_type == "QuantizeLinear")
    assert f"QuantizeLinear {first.name!r}: zero point type UINT8; a int8 graph needs INT8" in check_precision_claim(uint8, "int8")
    assert any(p.endswith("a fp8 graph needs FLOAT8E4M3FN") for p in check_precision_claim(uint8, "fp8"))


def test_bad_input_is_refused_naming_the_value_and_the_allowed_range(export_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(QdqError, match=r"^precision='int4' has no Q/DQ path; allowed: int8, fp8$"):
        write_qdq(export_dir / "decoder.onnx", tmp_path / "x.onnx", "int4", FeedReader([{}]))
    assert not (tmp_path / "x.onnx").exists()
    fp32 = onnx.load(str(export_dir / "decoder.onnx"), load_external_data=False).graph
    assert check_precision_claim(fp32, "fp8") == ["the manifest says fp8, but the graph has no QuantizeLinear: not a float 8 Q/DQ graph"]


def test_a_per_channel_zero_point_with_one_nonzero_channel_is_refused() -> None:
    def dequantize(zero_points: list[int], data_type: int = TensorProto.INT8) -> onnx.GraphProto:
        node = helper.make_node("DequantizeLinear", ["w", "s", "zp"], ["y"], name="dq_w", axis=0)
        inits = [
            helper.make_tensor("w", data_type, [3, 2], [1] * 6),
            helper.make_tensor("s", TensorProto.FLOAT, [3], [0.1] * 3),
            helper.make_tensor("zp", data_type, [3], zero_points),
        ]
        return helper.make_graph([node], "dq", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])], inits)

    assert check_precision_claim(dequantize([0, 0, 0]), "int8") == []
    assert check_precision_claim(dequantize([0, 3, 0]), "int8") == [
        "DequantizeLinear 'dq_w': nonzero zero point; TensorRT supports only symmetric quantization (zero point 0)"
    ]
    assert check_precision_claim(dequantize([0, 0, 0], TensorProto.UINT8), "int8") == [
        "DequantizeLinear 'dq_w': zero point type UINT8; a int8 graph needs INT8"
    ]
