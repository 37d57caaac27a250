"""The cast pass's numbers: bf16/fp16 weights against hand-computed bit patterns and torch's own
conversion, the FP32 islands, and the fp16 graph's outputs in ONNX Runtime against eager."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ldlm.export.precision import _low_initializer, lower_precision


def bf16_bits(tensor: TensorProto) -> np.ndarray:
    assert tensor.data_type == TensorProto.BFLOAT16
    return np.frombuffer(tensor.raw_data, dtype=np.uint16)


def test_bf16_rounding_against_hand_computed_bits() -> None:
    values = np.array(
        [
            1.0,  # 0x3F80_0000 -> 0x3F80
            -2.5,  # 0xC020_0000 -> 0xC020
            1 + 2**-8,  # exactly half way between 1 and 1 + 2^-7: ties to even, down -> 0x3F80
            1 + 3 * 2**-8,  # half way, odd below: ties to even, up -> 0x3F82
            1 + 2**-8 + 2**-20,  # just above half way: up -> 0x3F81
            0.0,
            3.0e38,  # large but finite: 0x7F61_B1E6 -> 0x7F62
        ],
        dtype=np.float32,
    )
    expected = np.array([0x3F80, 0xC020, 0x3F80, 0x3F82, 0x3F81, 0x0000, 0x7F62], dtype=np.uint16)
    np.testing.assert_array_equal(bf16_bits(_low_initializer(values, "w", TensorProto.BFLOAT16)), expected)


def test_bf16_weights_equal_torchs_rounding() -> None:
    array = (np.random.default_rng(0).standard_normal((64, 48)) * np.logspace(-6, 4, 48)).astype(np.float32)
    ours = bf16_bits(_low_initializer(array, "w", TensorProto.BFLOAT16)).reshape(array.shape)
    reference = torch.from_numpy(array).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, reference)
    decoded = (ours.astype(np.uint32) << 16).view(np.float32)
    assert np.all(np.abs(decoded - array) <= np.abs(array) * 2**-8)  # half an ulp of an 8-bit mantissa


def test_fp16_weights_equal_numpys_rounding() -> None:
    array = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32)
    tensor = _low_initializer(array, "w", TensorProto.FLOAT16)
    assert tensor.data_type == TensorProto.FLOAT16
    np.testing.assert_array_equal(numpy_helper.to_array(tensor), array.astype(np.float16))


def small_graph(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (2, 4) -> MatMul(W) -> LayerNormalization(scale, bias) -> MatMul(W2) -> y."""
    gen = np.random.default_rng(2)
    w, w2 = gen.standard_normal((4, 4)).astype(np.float32), gen.standard_normal((4, 3)).astype(np.float32)
    scale = (1 + 0.1 * gen.standard_normal(4)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="mm1"),
        helper.make_node("LayerNormalization", ["h", "scale", "bias"], ["n"], axis=-1, epsilon=1e-5, name="ln"),
        helper.make_node("MatMul", ["n", "W2"], ["y"], name="mm2"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [
            numpy_helper.from_array(w, "W"),
            numpy_helper.from_array(w2, "W2"),
            numpy_helper.from_array(scale, "scale"),
            numpy_helper.from_array(np.zeros(4, np.float32), "bias"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(onnx.shape_inference.infer_shapes(model), str(path))  # the cast pass reads value_info, as exports carry it
    return w, w2, scale


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_lowered_graph_keeps_layer_norm_fp32_and_rounds_matmul_weights(tmp_path: Path, precision: str) -> None:
    w, w2, scale = small_graph(tmp_path / "g.onnx")
    report = lower_precision(tmp_path / "g.onnx", tmp_path / "low.onnx", precision)
    model = onnx.load(str(tmp_path / "low.onnx"))
    inits = {i.name: i for i in model.graph.initializer}
    low = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}[precision]
    ln = next(n for n in model.graph.node if n.op_type == "LayerNormalization")
    assert inits[ln.input[1]].data_type == TensorProto.FLOAT
    np.testing.assert_array_equal(numpy_helper.to_array(inits[ln.input[1]]), scale)
    mm1 = next(n for n in model.graph.node if n.name == "mm1")
    weight = inits[mm1.input[1]]
    assert weight.data_type == low
    reference = torch.from_numpy(w).to(torch.float16 if precision == "fp16" else torch.bfloat16).float().numpy()
    if precision == "fp16":
        got = numpy_helper.to_array(weight).astype(np.float32)
    else:
        got = (bf16_bits(weight).astype(np.uint32) << 16).view(np.float32).reshape(w.shape)
    np.testing.assert_array_equal(got, reference)
    assert report.lowered_weights == 2 and report.lowered_nodes == 2
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT


def test_fp16_graph_runs_close_to_fp32_in_onnx_runtime(tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime", reason="runs the lowered graph (pip install -e .[cpu])")
    w, w2, scale = small_graph(tmp_path / "g.onnx")
    lower_precision(tmp_path / "g.onnx", tmp_path / "low.onnx", "fp16")
    x = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    got = ort.InferenceSession(str(tmp_path / "low.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    h = x.astype(np.float16).astype(np.float32) @ w.astype(np.float16).astype(np.float32)
    n = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5) * scale
    expected = n @ w2
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=2e-2, rtol=2e-2)


def test_the_head_feeding_argmax_stays_fp32(tmp_path: Path) -> None:
    """A decoder without a logits output: the vocabulary head is found from ArgMax back to its MatMul."""
    gen = np.random.default_rng(4)
    w, head = gen.standard_normal((4, 4)).astype(np.float32), gen.standard_normal((4, 10)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="body"),
        helper.make_node("Relu", ["h"], ["r"], name="act"),
        helper.make_node("MatMul", ["r", "HEAD"], ["logits_inner"], name="head"),
        helper.make_node("ArgMax", ["logits_inner"], ["token_ids"], axis=-1, keepdims=0, name="argmax"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("token_ids", TensorProto.INT64, [2])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(head, "HEAD")],
    )
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    onnx.save(model, str(tmp_path / "g.onnx"))
    lower_precision(tmp_path / "g.onnx", tmp_path / "low.onnx", "fp16")
    low = onnx.load(str(tmp_path / "low.onnx"))
    inits = {i.name: i.data_type for i in low.graph.initializer}
    by_name = {n.name: n for n in low.graph.node}
    assert inits[by_name["head"].input[1]] == TensorProto.FLOAT  # the head's weight is not rounded
    assert inits[by_name["body"].input[1]] == TensorProto.FLOAT16  # the body's is


def test_a_chunked_head_stays_fp32_from_its_features_to_the_token_ids(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The exported decoder without logits takes its argmax a chunk of the vocabulary at a time: every chunk's
    product, the comparison of the chunks' maxima and the features the head reads stay FP32 (a maximum rounded
    to FP16 would tie with its neighbours' and pick another token)."""
    from ldlm.export.onnx_export import export_graphs

    export_graphs(tiny_checkpoint, tmp_path / "export", graphs=("decoder",))
    lower_precision(tmp_path / "export" / "decoder.onnx", tmp_path / "low.onnx", "fp16")
    nodes = list(onnx.load(str(tmp_path / "low.onnx"), load_external_data=False).graph.node)
    last_norm = max(i for i, n in enumerate(nodes) if n.op_type == "LayerNormalization")
    head = nodes[last_norm + 1 :]
    assert sum(n.op_type in ("MatMul", "Gemm") for n in head) > 1  # one product per chunk
    lowered = [n.name for n in head if n.op_type == "Cast" and helper.get_attribute_value(n.attribute[0]) == TensorProto.FLOAT16]
    assert lowered == []
