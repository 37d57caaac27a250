"""Cast pass: an FP32 ONNX graph -> a strongly typed FP16 or BF16 variant with an explicit FP32 list.

TensorRT 11 and TensorRT-RTX build only strongly typed networks (the FP16/BF16 builder flags are
gone), so reduced precision has to be in the graph's own types. One pass serves every flavour:

  kept in FP32:  LayerNormalization; RMSNorm reductions (Pow -> ReduceMean -> Add -> Sqrt -> Div);
                 Softmax; the logits (the vocabulary head feeding ArgMax / the logits output);
                 anything that does not depend on the inputs' values (position tables, rotary
                 angles: positions up to 1024 lose their fraction in FP16)
  lowered:       the matmuls and elementwise ops between them
  graph I/O:     unchanged (FP32 in, FP32 out)

Casts are inserted where a tensor crosses between the two; a weight read only by lowered nodes
is stored in the low precision, halving its size.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

Precision = Literal["fp32", "fp16", "bf16"]
PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16")
LOW_TYPES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
FLOAT = TensorProto.FLOAT

# Ops whose float output has their float inputs' type: safe to run in the low type.
POLYMORPHIC_OPS = {
    "MatMul",
    "Gemm",
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Neg",
    "Sigmoid",
    "Tanh",
    "Erf",
    "Relu",
    "Gelu",
    "Concat",
    "Split",
    "Slice",
    "Reshape",
    "Transpose",
    "Squeeze",
    "Unsqueeze",
    "Expand",
    "Gather",
    "Where",
    "Identity",
    "Max",
    "Min",
}
KEEP_FP32_OPS = {"LayerNormalization", "Softmax", "Pow", "ReduceMean", "ReduceSum", "Sqrt", "Reciprocal", "Exp", "Log"}
SHAPE_OPS = {"Shape", "Size"}  # their outputs carry no data dependence
LAYOUT_OPS = {"Reshape", "Pad", "Concat", "Slice", "Squeeze", "Unsqueeze", "Transpose", "Identity"}  # move values, compute none


@dataclass(frozen=True)
class PrecisionReport:
    precision: str
    lowered_nodes: int
    fp32_nodes: int
    casts_inserted: int
    lowered_weights: int


def lower_precision(src: str | os.PathLike[str], dst: str | os.PathLike[str], precision: str) -> PrecisionReport:
    """Write the strongly typed ``precision`` variant of the ONNX file ``src`` to ``dst``."""
    if precision not in LOW_TYPES:
        raise ValueError(f"precision={precision!r} has no cast pass; allowed: {', '.join(LOW_TYPES)}")
    model = onnx.load(str(src))
    report = cast_graph(model.graph, LOW_TYPES[precision], precision)
    del model.graph.value_info[:]  # types changed; re-inferred below
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    dst = Path(dst)
    onnx.save(model, str(dst), save_as_external_data=True, location=dst.name + ".data", size_threshold=1024)
    onnx.checker.check_model(str(dst), full_check=True)
    return report


def cast_graph(graph: onnx.GraphProto, low: int, precision: str) -> PrecisionReport:
    types = _tensor_types(graph)
    keep = _fp32_nodes(graph, types)
    initializers = {init.name: init for init in graph.initializer}
    current = dict(types)  # the type each tensor has after the rewrite
    casts: dict[tuple[str, int], str] = {}
    new_nodes: list[onnx.NodeProto] = []
    lowered = lowered_weights = 0

    def converted(name: str, to: int) -> str:
        """``name`` in type ``to``: a converted weight, or the output of a (shared) Cast node."""
        nonlocal lowered_weights
        key = (name, to)
        if key not in casts:
            suffix = "fp32" if to == FLOAT else precision
            out = f"{name}__{suffix}"
            if name in initializers and to == low:
                array = numpy_helper.to_array(initializers[name]).astype(np.float32)
                graph.initializer.append(_low_initializer(array, out, low))
                lowered_weights += 1
            else:
                new_nodes.append(helper.make_node("Cast", [name], [out], to=to, name=f"cast_{out}"))
            current[out] = to
            casts[key] = out
        return casts[key]

    for index, node in enumerate(list(graph.node)):
        is_low = index not in keep and node.op_type in POLYMORPHIC_OPS and _reads_float(node, types)
        target = low if is_low else FLOAT
        if node.op_type != "Cast":  # a Cast takes any type
            for i, name in enumerate(node.input):
                if name and current.get(name) in (FLOAT, low) and current[name] != target:
                    node.input[i] = converted(name, target)
        for out in node.output:
            if types.get(out) == FLOAT and node.op_type != "Cast":
                current[out] = target
        lowered += is_low
        new_nodes.append(node)

    for output in graph.output:  # graph outputs keep their FP32 type
        if current.get(output.name) == low:
            producer = next(n for n in new_nodes if output.name in n.output)
            inner = f"{output.name}__{precision}"
            producer.output[list(producer.output).index(output.name)] = inner
            new_nodes.append(helper.make_node("Cast", [inner], [output.name], to=FLOAT, name=f"cast_{output.name}"))
    inserted = sum(1 for n in new_nodes if n.name.startswith("cast_"))
    _drop_unused_initializers(graph, new_nodes)
    del graph.node[:]
    graph.node.extend(new_nodes)
    return PrecisionReport(precision, lowered, len(new_nodes) - lowered - inserted, inserted, lowered_weights)


def _low_initializer(array: np.ndarray, name: str, low: int) -> TensorProto:
    if low == TensorProto.FLOAT16:
        return numpy_helper.from_array(array.astype(np.float16), name)
    # bfloat16: the upper 16 bits of float32, rounded to nearest even
    bits = array.astype(np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    tensor = helper.make_tensor(name, TensorProto.BFLOAT16, array.shape, rounded.tobytes(), raw=True)
    return tensor


def _tensor_types(graph: onnx.GraphProto) -> dict[str, int]:
    types = {init.name: init.data_type for init in graph.initializer}
    for value in [*graph.input, *graph.output, *graph.value_info]:
        types[value.name] = value.type.tensor_type.elem_type
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    types[node.output[0]] = attr.t.data_type
    return types


def _reads_float(node: onnx.NodeProto, types: dict[str, int]) -> bool:
    return any(types.get(name) == FLOAT for name in node.input if name)


def _fp32_nodes(graph: onnx.GraphProto, types: dict[str, int]) -> set[int]:
    """Indices of nodes that stay FP32: the keep list, the RMSNorm reductions, the logits, and
    every node whose inputs do not depend on the graph inputs' values."""
    nodes = list(graph.node)
    producer = {out: i for i, n in enumerate(nodes) for out in n.output}
    consumers: dict[str, list[int]] = defaultdict(list)
    for i, n in enumerate(nodes):
        for name in n.input:
            consumers[name].append(i)

    keep = {i for i, n in enumerate(nodes) if n.op_type in KEEP_FP32_OPS}
    # RMSNorm: ReduceMean(Pow(x, 2)) -> Add(eps) -> Sqrt -> Div(x, .); keep the Add, Sqrt and Div too.
    for n in nodes:
        if n.op_type == "ReduceMean" and n.input[0] in producer and nodes[producer[n.input[0]]].op_type == "Pow":
            frontier = list(n.output)
            for _ in range(3):
                following = [c for name in frontier for c in consumers[name] if nodes[c].op_type in ("Add", "Sqrt", "Div", "Reciprocal")]
                keep.update(following)
                frontier = [out for c in following for out in nodes[c].output]
    # Logits: walk back from ArgMax's input and from any "logits" output along every float input to the
    # head's MatMul/Gemm nodes (a head that takes its argmax a chunk of the vocabulary at a time has one per
    # chunk, and compares the chunks' maxima), then from the head through layout ops to the features it reads.
    starts = [n.input[0] for n in nodes if n.op_type == "ArgMax"] + [o.name for o in graph.output if "logits" in o.name]
    walk, seen = [(name, False) for name in starts], set()
    while walk:
        name, past_head = walk.pop()
        if name not in producer or name in seen:
            continue
        i = producer[name]
        if past_head and nodes[i].op_type not in LAYOUT_OPS:
            continue
        seen.add(name)
        keep.add(i)
        past_head = past_head or nodes[i].op_type in ("MatMul", "Gemm")
        walk += [(x, past_head) for x in nodes[i].input if types.get(x) == FLOAT]
    # Value dependence on the graph inputs, cut at shape ops.
    dependent = {value.name for value in graph.input}
    for n in nodes:
        if n.op_type not in SHAPE_OPS and any(name in dependent for name in n.input):
            dependent.update(n.output)
    keep |= {i for i, n in enumerate(nodes) if not any(name in dependent for name in n.input)}
    return keep


def _drop_unused_initializers(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    used = {name for n in nodes for name in n.input}
    kept = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
