"""Eps probes on TensorRT: each INormalizationLayer as a one-layer engine.

A plan is a compiled blob: its layers cannot be taken out of it. So the ONNX each plan was built
from (checked against the sha256 in the plan's manifest) is parsed again with the same TensorRT
flavour, which gives the INormalizationLayers exactly as the builder saw them: epsilon, axes, and
the scale and bias constants. Each becomes a one-layer float32 engine (built ahead of time, which
TensorRT-RTX does without a GPU), whose epsilon is read back from its network definition; running
it on the probe rows needs a GPU, and without one the report says so in ``not_exercised``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import numpy as np
import onnx
import torch
from torch import nn
from tqdm.auto import tqdm

from ldlm.export.artifact import read_plan_manifest, sha256_file
from ldlm.export.graphs import GRAPH_NAMES, graph_io
from ldlm.export.layernorm.eps_probe import EpsProbeReport, LayerNormProbe, analyse_outputs, eps_rtol, probe_rows, run_cases
from ldlm.export.layernorm.trt_network import (
    NormalizationPlan,
    axes_mask,
    build_normalization_plan,
    parse_onnx_network,
    read_normalization_layers,
)
from ldlm.export.layernorm.verify import LAYER_NORM_OP, eps_matches, pair_layer_norm_nodes
from ldlm.export.onnx_export import graph_layer_norm_specs
from ldlm.export.trt_flavor import Flavor, bind, flavor_logger, gpu_info, load_flavor
from ldlm.model.ldlm import LDLM

NO_GPU = (
    "no CUDA GPU: the one-layer TensorRT engines were built and their INormalizationLayer eps read back, "
    "but not executed (deserialize_cuda_engine, execute_async_v3), so no implied eps and no output check "
    "for the LayerNorms, and the fixed cases did not run on TensorRT"
)


def run_normalization_plan(flavor: Flavor, plan: NormalizationPlan, x: np.ndarray) -> np.ndarray:
    """Run a one-layer plan on the GPU: x (float32, plan.input_shape) -> y, with the runtime's
    checked binding, on a stream of its own."""
    if not torch.cuda.is_available():
        raise RuntimeError("running a TensorRT plan needs a CUDA GPU; torch.cuda.is_available() is False")
    logger = flavor_logger(flavor)
    runtime = flavor.trt.Runtime(logger)
    with logger.capture() as messages:
        engine = runtime.deserialize_cuda_engine(plan.plan)
    if engine is None:
        raise RuntimeError(f"TensorRT could not deserialize the one-layer plan: {'; '.join(m for _, m in messages) or 'no details'}")
    context = engine.create_execution_context()
    device = torch.device("cuda")
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        x_gpu = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(device)
        y_gpu = bind(context, {"x": x_gpu}, ["y"], {"y": torch.float32}, device)["y"]
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("execute_async_v3 failed for the one-layer normalization plan")
    stream.synchronize()
    return y_gpu.cpu().numpy()


def locate_plan_onnx(engine_dir: Path, manifest: dict[str, Any], onnx_dir: Path | None) -> tuple[Path | None, str | None]:
    """The ONNX a plan was parsed from: ``onnx_dir``, then the engine dir (fp16/bf16 variants are
    written there), then the path recorded at build time; it must match the manifest's sha256."""
    name = manifest["onnx"]["file"]
    candidates = ([onnx_dir / name] if onnx_dir else []) + [engine_dir / name, Path(manifest.get("source_onnx", {}).get("file", name))]
    for path in candidates:
        if path.is_file():
            if sha256_file(path) == manifest["onnx"]["sha256"]:
                return path, None
            return None, f"{path} is not the ONNX {manifest['plan']} was built from (sha256 differs from its manifest)"
    where = ", ".join(str(c) for c in candidates)
    return None, f"the ONNX {manifest['plan']} was built from is not found (looked at {where}); pass --onnx-dir"


def probe_engines(
    model: LDLM, engine_dir: Path, onnx_dir: Path | None, seed: int, flavor_name: str | None, progress: bool = False, *, backend: str
) -> EpsProbeReport:
    """Every INormalizationLayer of every plan in ``engine_dir``, each built and run alone; ``backend`` names the
    backend that runs engines, for the report."""
    graphs = [g for g in GRAPH_NAMES if (engine_dir / f"{g}.plan").is_file()]
    if not graphs:
        raise ValueError(f"{engine_dir} has no {', '.join(g + '.plan' for g in GRAPH_NAMES)}; make one with `ldlm build-engine`")
    manifests = {g: read_plan_manifest(engine_dir / f"{g}.plan") for g in graphs}
    flavor = load_flavor(flavor_name or manifests[graphs[0]]["flavor"])
    can_run = gpu_info().name is not None
    report = EpsProbeReport(backend, f"{flavor.name} {flavor.version}" + ("" if can_run else " (AOT only, no GPU)"), str(engine_dir))
    for graph in graphs:
        manifest = manifests[graph]
        path, problem = locate_plan_onnx(engine_dir, manifest, onnx_dir)
        if path is None:
            report.problems.append(f"{graph}: {problem}")
            continue
        specs = graph_layer_norm_specs(model, graph_io(model, graph))
        proto = onnx.load(str(path), load_external_data=False)
        nodes = [n for n in proto.graph.node if n.op_type == LAYER_NORM_OP]
        module_of = {node.name: spec.name for node, spec in pair_layer_norm_nodes(nodes, specs)}
        _, network, _ = parse_onnx_network(flavor, path)
        layers = read_normalization_layers(flavor.trt, network)
        if len(layers) != len(specs):
            report.problems.append(f"{graph}: {len(layers)} INormalizationLayer(s) after parsing, {len(specs)} nn.LayerNorm module(s)")
        for layer in tqdm(layers, desc=f"eps probes {graph}", unit="layer", disable=not progress):
            if layer.name not in module_of:  # TensorRT's parser names a layer after its ONNX node
                report.problems.append(f"{graph}: INormalizationLayer {layer.name!r} matches no LayerNormalization node of {path.name}")
                continue
            report.layer_norms.append(probe_layer(flavor, graph, layer, module_of[layer.name], model, seed, can_run))
    if not can_run:
        report.not_exercised.append(NO_GPU)

    def run_case(x: np.ndarray, axis: int, scale: np.ndarray | None, bias: np.ndarray | None, eps: float) -> np.ndarray | None:
        shape = x.shape[axis:]
        plan = build_normalization_plan(
            flavor, x.shape, axes_mask(axis, x.ndim), eps, np.ones(shape, np.float32) if scale is None else scale, bias
        )
        return run_normalization_plan(flavor, plan, x) if can_run else None

    report.cases = run_cases(run_case, ("float32",))  # TensorRT takes no float64 (layernorm-cases.md)
    return report


def probe_layer(flavor: Flavor, graph: str, layer: Any, module_name: str, model: LDLM, seed: int, can_run: bool) -> LayerNormProbe:
    module = cast(nn.LayerNorm, model.get_submodule(module_name.removeprefix("model.")))  # the manifest lists nn.LayerNorm modules
    n = math.prod(module.normalized_shape)
    probe = LayerNormProbe(graph, layer.name, module_name, float(module.eps), layer.epsilon, eps_rtol(n, float(module.eps)))
    where = f"layer {layer.name!r} (module {module_name})"
    if not eps_matches(layer.epsilon, module.eps):
        probe.problems.append(f"{where}: epsilon {layer.epsilon:g} after parsing != module eps {module.eps:g} (compared as float32)")
    if layer.input_dtype != "FLOAT":
        probe.problems.append(f"{where}: runs in {layer.input_dtype}; LayerNorms must stay in FP32")
    if layer.scale is None or layer.scale.size != n or (layer.bias is not None and layer.bias.size != n):
        probe.problems.append(f"{where}: scale or bias is not a constant of {n} values; cannot build it alone")
        return probe
    normalized = bin(layer.axes).count("1")
    rows = probe_rows(n, seed)
    shape = (1, len(rows.family), *module.normalized_shape)  # (1, rows, *normalized), rank of (B, L, D)
    if normalized != len(module.normalized_shape):
        probe.problems.append(f"{where}: normalizes {normalized} axes, the module {len(module.normalized_shape)}")
        return probe
    plan = build_normalization_plan(flavor, shape, axes_mask(-normalized, len(shape)), layer.epsilon, layer.scale, layer.bias)
    if plan.epsilon != layer.epsilon:
        probe.problems.append(f"{where}: the one-layer engine holds epsilon {plan.epsilon:g}, not the parsed {layer.epsilon:g}")
    if can_run:
        y = run_normalization_plan(flavor, plan, rows.x.reshape(shape))
        analyse_outputs(probe, rows, y.reshape(len(rows.family), n), layer.scale, layer.bias, module)
    return probe
