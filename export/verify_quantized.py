"""What verification adds for quantization: no Q/DQ on any LayerNorm, float32 norms, and graphs that are
the precision their manifest says. ``verify.verify_onnx`` runs these on every graph, fp32 or not:
ONNX Runtime's static QDQ path with its default op list puts DequantizeLinear on the input, scale
and bias of every LayerNormalization, and NVIDIA ModelOpt's FP8 path casts norms to fp16.
"""

from __future__ import annotations

import onnx

LAYER_NORM_OP = "LayerNormalization"
QUANTIZED_OPS = frozenset(
    {"MatMulInteger", "DynamicQuantizeLinear", "DynamicQuantizeMatMul", "QLinearMatMul", "QGemm", "QuantizeLinear", "DequantizeLinear"}
)
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
LAYER_NORM_INPUTS = ("X", "scale", "bias")
# what a LayerNorm may compute in: float32, or float64 where the module is double (never fp16, bf16, fp8)
WIDE_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE})


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
    return problems


def check_precision_claim(graph: onnx.GraphProto, precision: str) -> list[str]:
    """A graph is what its manifest says: an int8 variant has quantized ops, an fp32 graph has none."""
    found = quantized_ops(graph)
    if precision == "int8" and not found:
        return ["the manifest says int8, but the graph has no quantized op (MatMulInteger, DynamicQuantizeLinear, Q/DQ): an fp32 file?"]
    if precision == "fp32" and found:
        return [f"the manifest says fp32, but the graph has {len(found)} quantized op(s), e.g. {found[0]!r}"]
    return []


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
