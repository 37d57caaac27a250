"""What verification adds for quantization: no Q/DQ on any norm (LayerNorm or RMSNorm), float32
LayerNorms, and graphs that are the precision their manifest says. ``verify.verify_onnx`` runs these
on every graph, fp32 or not: ONNX Runtime's static QDQ path with its default op list puts
DequantizeLinear on the input, scale and bias of every LayerNormalization, and NVIDIA ModelOpt's FP8
path casts norms to fp16.

Where an explicit Q/DQ graph for TensorRT (export/qdq.py) legitimately differs from ONNX Runtime's
dynamic INT8 variant: its quantized ops are QuantizeLinear/DequantizeLinear pairs instead of
MatMulInteger, an fp8 graph has float 8 zero points, and TensorRT takes only symmetric quantization,
so every zero point must be 0.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

LAYER_NORM_OP = "LayerNormalization"
QUANTIZED_OPS = frozenset(
    {"MatMulInteger", "DynamicQuantizeLinear", "DynamicQuantizeMatMul", "QLinearMatMul", "QGemm", "QuantizeLinear", "DequantizeLinear"}
)
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
LAYER_NORM_INPUTS = ("X", "scale", "bias")
# what a LayerNorm may compute in: float32, or float64 where the module is double (never fp16, bf16, fp8)
WIDE_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE})
# RMSNorm as torch.onnx writes it: Pow(x, 2) -> ReduceMean -> Add(eps) -> Sqrt -> Div(x, .) -> Mul(scale);
# the ops after ReduceMean that belong to the norm (its output Mul reads the scale)
RMS_NORM_TAIL = ("Add", "Sqrt", "Div", "Reciprocal", "Mul")
# zero point types per precision claimed for a Q/DQ graph (TensorRT: int8 or float 8 E4M3, symmetric)
QDQ_ZERO_POINT_TYPES = {"int8": onnx.TensorProto.INT8, "fp8": onnx.TensorProto.FLOAT8E4M3FN}


def quantized_ops(graph: onnx.GraphProto) -> list[str]:
    return [n.name or n.op_type for n in graph.node if n.op_type in QUANTIZED_OPS]


def check_quantized_layer_norms(model: onnx.ModelProto) -> list[str]:
    """Every LayerNormalization reads float32 (or float64) tensors that no Q/DQ node made, and writes the same.

    A Q/DQ pair on a LayerNorm's input, scale or bias (ONNX Runtime's static QDQ path with its default
    op list puts DequantizeLinear on all three) means the norm no longer sees the module's values."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    types = _float_types(model)
    problems = []
    for node in (n for n in graph.node if n.op_type == LAYER_NORM_OP):
        where = f"LayerNormalization {node.name or node.output[0]!r}"
        for role, name in zip(LAYER_NORM_INPUTS, node.input):
            made_by = producer.get(name)
            if made_by is not None and made_by.op_type in QDQ_OPS:
                problems.append(f"{where}: its {role} {name!r} comes from {made_by.op_type} {made_by.name!r} (a Q/DQ pair on a LayerNorm)")
            elif types.get(name, onnx.TensorProto.FLOAT) not in WIDE_FLOATS:
                type_name = onnx.TensorProto.DataType.Name(types[name])
                problems.append(f"{where}: its {role} {name!r} is {type_name}; a LayerNorm computes in float32 (or float64)")
        out_type = types.get(node.output[0], onnx.TensorProto.FLOAT)
        if out_type not in WIDE_FLOATS:
            problems.append(
                f"{where}: its output is {onnx.TensorProto.DataType.Name(out_type)}; a LayerNorm computes in float32 (or float64)"
            )
    return problems + check_quantized_rms_norms(graph)


def graph_links(graph: onnx.GraphProto) -> tuple[dict[str, onnx.NodeProto], dict[str, list[onnx.NodeProto]]]:
    """Each tensor's producing node, and the nodes that read it."""
    producer = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return producer, consumers


def check_quantized_rms_norms(graph: onnx.GraphProto) -> list[str]:
    """No input of an RMSNorm's ops (Pow, ReduceMean, Add, Sqrt, Div, the scale's Mul) comes from a Q/DQ node:
    the norm's statistics and its division must see the float residual stream, as LayerNorms must."""
    producer, consumers = graph_links(graph)
    problems = []
    for mean in graph.node:
        square = producer.get(mean.input[0]) if mean.op_type == "ReduceMean" and mean.input else None
        if square is None or square.op_type != "Pow":
            continue
        chain, frontier = [square, mean], list(mean.output)
        for _ in range(len(RMS_NORM_TAIL)):
            following = [c for name in frontier for c in consumers.get(name, []) if c.op_type in RMS_NORM_TAIL]
            chain += following
            frontier = [out for c in following for out in c.output]
        for node in chain:
            for name in node.input:
                made_by = producer.get(name)
                if made_by is not None and made_by.op_type in QDQ_OPS:
                    problems.append(
                        f"RMSNorm {node.op_type} {node.name!r}: its input {name!r} comes from {made_by.op_type} {made_by.name!r} "
                        "(a Q/DQ pair on an RMSNorm)"
                    )
    return problems


def check_precision_claim(graph: onnx.GraphProto, precision: str) -> list[str]:
    """A graph is what its manifest says: an int8 graph has quantized ops, an fp8 graph float 8 Q/DQ pairs, an
    fp32 graph none; every Q/DQ pair of an int8 or fp8 graph has its precision's zero point type, zero."""
    found = quantized_ops(graph)
    if precision == "int8" and not found:
        return ["the manifest says int8, but the graph has no quantized op (MatMulInteger, DynamicQuantizeLinear, Q/DQ): an fp32 file?"]
    if precision == "fp8" and not any(n.op_type == "QuantizeLinear" for n in graph.node):
        return ["the manifest says fp8, but the graph has no QuantizeLinear: not a float 8 Q/DQ graph"]
    if precision == "fp32" and found:
        return [f"the manifest says fp32, but the graph has {len(found)} quantized op(s), e.g. {found[0]!r}"]
    return check_qdq_zero_points(graph, precision) if precision in QDQ_ZERO_POINT_TYPES else []


def check_qdq_zero_points(graph: onnx.GraphProto, precision: str) -> list[str]:
    """Every QuantizeLinear/DequantizeLinear has a constant zero point of ``precision``'s type, all zeros: the
    quantized type is the zero point's, and TensorRT supports only symmetric quantization."""
    wanted = QDQ_ZERO_POINT_TYPES[precision]
    constants = {init.name: init for init in graph.initializer}
    problems = []
    for node in (n for n in graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")):
        where = f"{node.op_type} {node.name!r}"
        zero_point = constants.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if zero_point is None:
            problems.append(f"{where}: no constant zero point; a {precision} Q/DQ pair needs one of type {_type_name(wanted)}")
        elif zero_point.data_type != wanted:
            problems.append(f"{where}: zero point type {_type_name(zero_point.data_type)}; a {precision} graph needs {_type_name(wanted)}")
        elif numpy_helper.to_array(zero_point).astype(np.float32).any():
            problems.append(f"{where}: nonzero zero point; TensorRT supports only symmetric quantization (zero point 0)")
    return problems


def _type_name(data_type: int) -> str:
    return str(onnx.TensorProto.DataType.Name(data_type))


def _float_types(model: onnx.ModelProto) -> dict[str, int]:
    """The element type of every tensor the graph names, as declared or as shape inference finds it."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # inference is best effort: declared types still count
        inferred = model
    graph = inferred.graph
    types = {init.name: init.data_type for init in graph.initializer}
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.HasField("tensor_type"):
            types[value.name] = value.type.tensor_type.elem_type
    return types
