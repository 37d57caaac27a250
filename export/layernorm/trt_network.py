"""The LayerNorm check on a parsed TensorRT network: the ONNX promise, seen from NVIDIA's side.

After parsing, every LayerNormalization must be one INormalizationLayer whose epsilon equals the
module's eps (as float32) and whose axes bit mask covers the normalized axes; the count must equal
the ONNX count. Layers are matched to modules in network order, which is the ONNX node order.

The eps probes (export/layernorm/eps_probe.py) also read each layer's epsilon, axes, scale and bias back from
a parsed network, and build one engine per layer holding that layer alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ldlm.export.layernorm.verify import LayerNormSpec, eps_matches
from ldlm.export.trt_flavor import EngineBuildError, flavor_logger, network_flags
from ldlm.interrupts import deferred_interrupts, raise_if_interrupted


def normalization_layers(trt: Any, network: Any) -> list[Any]:
    layers = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.NORMALIZATION:
            layer.__class__ = trt.INormalizationLayer  # the Python API hands out the base ILayer
            layers.append(layer)
    return layers


def axes_mask(axis: int, rank: int) -> int:
    """LayerNormalization normalizes axes [axis, rank): one bit per axis."""
    first = axis % rank
    return sum(1 << a for a in range(first, rank))


def check_network_layer_norms(trt: Any, network: Any, specs: Sequence[LayerNormSpec]) -> list[str]:
    layers = normalization_layers(trt, network)
    problems = []
    if len(layers) != len(specs):
        problems.append(f"{len(layers)} INormalizationLayer(s) after parsing, {len(specs)} LayerNormalization node(s) expected")
    for layer, spec in zip(layers, specs):
        where = f"layer {layer.name!r} (module {spec.name})"
        if not eps_matches(layer.epsilon, spec.eps):
            problems.append(f"{where}: epsilon {layer.epsilon:g} != module eps {spec.eps:g} (compared as float32)")
        rank = len(layer.get_input(0).shape)
        expected = axes_mask(spec.axis, rank)
        if layer.axes != expected:
            problems.append(f"{where}: axes mask {layer.axes:#b} != {expected:#b} (axis {spec.axis} of a rank-{rank} input)")
        if getattr(layer, "num_groups", 1) != 1:
            problems.append(f"{where}: num_groups {layer.num_groups} != 1 (not a LayerNorm)")
    return problems


# --- one INormalizationLayer at a time: what the eps probes build and run ------------------------


@dataclass
class NormalizationLayerInfo:
    """One INormalizationLayer as TensorRT holds it: epsilon, axes, and its scale and bias constants
    (followed through the parser's broadcast shuffles), flattened to the normalized shape."""

    name: str  # TensorRT's ONNX parser names a layer after its ONNX node
    epsilon: float
    axes: int
    input_dtype: str
    scale: np.ndarray | None
    bias: np.ndarray | None


def parse_onnx_network(flavor: Any, onnx_path: str | Path) -> tuple[Any, Any, Any]:
    """(builder, network, parser) of ``onnx_path``, parsed from the path so external data is found."""
    trt = flavor.trt
    logger = flavor_logger(flavor)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineBuildError(f"TensorRT's ONNX parser rejected {onnx_path}: {errors or 'no details'}")
    return builder, network, parser


def read_normalization_layers(trt: Any, network: Any) -> list[NormalizationLayerInfo]:
    producers = {}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        for j in range(layer.num_outputs):
            producers[layer.get_output(j).name] = layer
    infos = []
    for layer in normalization_layers(trt, network):
        scale, bias = (_constant_value(trt, producers, layer.get_input(k)) if layer.num_inputs > k else None for k in (1, 2))
        infos.append(NormalizationLayerInfo(layer.name, float(layer.epsilon), int(layer.axes), layer.get_input(0).dtype.name, scale, bias))
    return infos


def _constant_value(trt: Any, producers: dict[str, Any], tensor: Any) -> np.ndarray | None:
    """The constant behind ``tensor``, through shuffles (reshapes for broadcasting); None otherwise."""
    layer = producers.get(tensor.name) if tensor is not None else None
    while layer is not None and layer.type == trt.LayerType.SHUFFLE:
        layer = producers.get(layer.get_input(0).name)
    if layer is None or layer.type != trt.LayerType.CONSTANT:
        return None
    layer.__class__ = trt.IConstantLayer
    return np.array(layer.weights, dtype=np.float32).reshape(-1)


@dataclass
class NormalizationPlan:
    """A serialized one-layer engine and the epsilon/axes read back from its network definition."""

    plan: bytes
    epsilon: float
    axes: int
    input_shape: tuple[int, ...]


def build_normalization_plan(
    flavor: Any,
    input_shape: tuple[int, ...],
    axes: int,
    epsilon: float,
    scale: np.ndarray,
    bias: np.ndarray | None,
) -> NormalizationPlan:
    """Build a float32 engine holding one INormalizationLayer: x -> normalize(x, scale, bias) -> y.

    Scale and bias are constants shaped to broadcast over the non-normalized axes. Builds ahead of
    time without a GPU with TensorRT-RTX; running the plan needs one (``serve.checks.eps_probe_trt.run_normalization_plan``).
    """
    trt = flavor.trt
    logger = flavor_logger(flavor)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    x = network.add_input("x", trt.float32, tuple(input_shape))
    param_shape = tuple(s if axes >> a & 1 else 1 for a, s in enumerate(input_shape))
    # trt.Weights does not copy: the arrays must outlive the build.
    scale32 = np.ascontiguousarray(np.asarray(scale, np.float32).reshape(param_shape))
    bias32 = np.ascontiguousarray(np.zeros(param_shape, np.float32) if bias is None else np.asarray(bias, np.float32).reshape(param_shape))
    scale_t = network.add_constant(param_shape, trt.Weights(scale32)).get_output(0)
    bias_t = network.add_constant(param_shape, trt.Weights(bias32)).get_output(0)
    layer = network.add_normalization(x, scale_t, bias_t, axes)
    layer.epsilon = float(epsilon)
    layer.get_output(0).name = "y"
    network.mark_output(layer.get_output(0))
    read_back = normalization_layers(trt, network)[0]
    # deferred: raised in TensorRT's logger, a Ctrl-C would be printed and lost; delivered after the build
    with logger.capture() as messages, deferred_interrupts():
        serialized = builder.build_serialized_network(network, builder.create_builder_config())
    raise_if_interrupted()
    if serialized is None:
        errors = "; ".join(m for s, m in messages if s in ("ERROR", "INTERNAL_ERROR"))
        raise EngineBuildError(f"TensorRT could not build a one-layer normalization engine: {errors or 'no details'}")
    return NormalizationPlan(bytes(serialized), float(read_back.epsilon), int(read_back.axes), tuple(input_shape))
