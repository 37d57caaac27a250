"""Eps probes on ONNX Runtime: each LayerNormalization node as a one-node ONNX.

The one-node model carries the node's own attributes (epsilon, axis, stash_type) verbatim and its
own scale and bias initializers, so what runs is exactly what the exported graph asks for; only the
input is the probe's. Weights are read per tensor, so a base export's 1.5 GB is not loaded.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import numpy as np
import onnx
from onnx import helper, numpy_helper
from torch import nn
from tqdm.auto import tqdm

from ldlm.export.artifact import read_manifest
from ldlm.export.graphs import graph_io
from ldlm.export.layernorm.eps_probe import EpsProbeReport, LayerNormProbe, analyse_outputs, eps_rtol, probe_rows, run_cases
from ldlm.export.layernorm.verify import LAYER_NORM_OP, ONNX_DEFAULT_EPS, pair_layer_norm_nodes
from ldlm.export.onnx_export import graph_layer_norm_specs
from ldlm.model.ldlm import LDLM


def one_node_model(
    attributes: list[onnx.AttributeProto], x_shape: tuple[int, ...], scale: np.ndarray, bias: np.ndarray | None, opset: int, ir_version: int
) -> onnx.ModelProto:
    """x -> LayerNormalization(x, scale[, bias]) -> y, with ``attributes`` copied as they are."""
    elem = helper.np_dtype_to_tensor_dtype(scale.dtype)
    inputs = ["x", "scale"] + ([] if bias is None else ["bias"])
    node = helper.make_node(LAYER_NORM_OP, inputs, ["y"], name="eps_probe")
    node.attribute.extend(attributes)
    initializers = [numpy_helper.from_array(scale, "scale")] + ([] if bias is None else [numpy_helper.from_array(bias, "bias")])
    graph = helper.make_graph(
        [node],
        "eps_probe",
        [helper.make_tensor_value_info("x", elem, list(x_shape))],
        [helper.make_tensor_value_info("y", elem, list(x_shape))],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model


class OrtNodeRunner:
    def __init__(self, providers: tuple[str, ...]) -> None:
        import onnxruntime as ort  # optional (the [cpu] or [gpu] extra): only the ort probes need it

        self.ort = ort
        self.providers = list(providers)
        self.options = ort.SessionOptions()
        self.options.intra_op_num_threads = 1
        available = ort.get_available_providers()
        unknown = [p for p in providers if p not in available]
        if unknown:
            raise ValueError(f"ONNX Runtime providers {unknown} are not available here; allowed: {available}")

    def run(self, model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
        session = self.ort.InferenceSession(model.SerializeToString(), self.options, providers=self.providers)
        return session.run(["y"], {"x": x})[0]

    def run_case(self, x: np.ndarray, axis: int, scale: np.ndarray | None, bias: np.ndarray | None, eps: float) -> np.ndarray:
        """A design-page case: LayerNormalization needs a scale, so none is all ones (as the exporter does)."""
        if scale is None:
            scale = np.ones(x.shape[axis:], x.dtype)
        attributes = [helper.make_attribute("axis", axis), helper.make_attribute("epsilon", eps)]
        return self.run(one_node_model(attributes, x.shape, scale, bias, 18, 9), x)

    @property
    def runtime(self) -> str:
        return f"onnxruntime {self.ort.__version__} {self.providers[0]}"


def _tensors(proto: onnx.ModelProto, names: set[str], base_dir: Path) -> dict[str, np.ndarray]:
    """Only the named initializers (external data read per tensor) and Constant outputs."""
    found = {t.name: numpy_helper.to_array(t, base_dir=str(base_dir)) for t in proto.graph.initializer if t.name in names}
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.output[0] in names:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                found[node.output[0]] = numpy_helper.to_array(value)
    return found


def probe_onnx_export(
    model: LDLM, onnx_dir: Path, seed: int, providers: tuple[str, ...], progress: bool = False, *, backend: str
) -> EpsProbeReport:
    """Every LayerNormalization node of every graph file of the export: the fp32 graphs and their
    quantized variants (``decoder.int8`` ...), each node probed alone; ``backend`` names the backend that runs
    exports, for the report."""
    manifest = read_manifest(onnx_dir)
    runner = OrtNodeRunner(providers)
    report = EpsProbeReport(backend, runner.runtime, str(onnx_dir))
    files = [(graph, graph, entry["file"]) for graph, entry in manifest["graphs"].items()]
    files += [
        (graph, f"{graph}.{precision}", variant["file"])
        for graph, entry in manifest["graphs"].items()
        for precision, variant in entry.get("variants", {}).items()
    ]
    for graph, label, file in files:
        path = onnx_dir / file
        proto = onnx.load(str(path), load_external_data=False)
        opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 18)
        nodes = [n for n in proto.graph.node if n.op_type == LAYER_NORM_OP]
        specs = graph_layer_norm_specs(model, graph_io(model, graph))
        if len(nodes) != len(specs):
            report.problems.append(f"{label}: {len(nodes)} LayerNormalization node(s) but {len(specs)} nn.LayerNorm module(s)")
        tensors = _tensors(proto, {name for n in nodes for name in n.input[1:] if name}, path.parent)
        for node, spec in tqdm(pair_layer_norm_nodes(nodes, specs), desc=f"eps probes {label}", unit="LayerNorm", disable=not progress):
            report.layer_norms.append(probe_node(runner, label, node, spec.name, model, tensors, opset, proto.ir_version, seed))
    report.cases = run_cases(runner.run_case, ("float32", "float64"))
    return report


def probe_node(
    runner: OrtNodeRunner,
    graph: str,
    node: onnx.NodeProto,
    module_name: str,
    model: LDLM,
    tensors: dict[str, np.ndarray],
    opset: int,
    ir_version: int,
    seed: int,
) -> LayerNormProbe:
    module = cast(nn.LayerNorm, model.get_submodule(module_name.removeprefix("model.")))  # the manifest lists nn.LayerNorm modules
    attrs: dict[str, Any] = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    n = math.prod(module.normalized_shape)
    probe = LayerNormProbe(
        graph,
        node.name or node.output[0],
        module_name,
        float(module.eps),
        float(attrs.get("epsilon", ONNX_DEFAULT_EPS)),
        eps_rtol(n, float(module.eps)),
    )
    scale = tensors.get(node.input[1]) if len(node.input) > 1 else None
    bias = tensors.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if scale is None or (len(node.input) > 2 and node.input[2] and bias is None):
        probe.problems.append(
            f"node {probe.node!r} (module {module_name}): scale or bias is not an initializer or constant; cannot run it alone"
        )
        return probe
    rows = probe_rows(n, seed)
    x = rows.x.reshape(1, len(rows.family), *module.normalized_shape).astype(scale.dtype)  # (1, rows, *normalized), rank of (B, L, D)
    try:
        y = runner.run(one_node_model(list(node.attribute), x.shape, scale, bias, opset, ir_version), x)
    except Exception as error:  # ONNX Runtime raises its own Fail/InvalidArgument types
        probe.problems.append(f"node {probe.node!r} (module {module_name}): ONNX Runtime cannot run it alone: {str(error).splitlines()[0]}")
        return probe
    analyse_outputs(probe, rows, y.reshape(len(rows.family), n), scale, bias, module)
    return probe
