"""The LayerNorm check on a parsed TensorRT network: the ONNX promise, seen from NVIDIA's side.

After parsing, every LayerNormalization must be one INormalizationLayer whose epsilon equals the
module's eps (as float32) and whose axes bit mask covers the normalized axes; the count must equal
the ONNX count. Layers are matched to modules in network order, which is the ONNX node order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ldlm.export.verify import LayerNormSpec


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
        if np.float32(layer.epsilon) != np.float32(spec.eps):
            problems.append(f"{where}: epsilon {layer.epsilon:g} != module eps {spec.eps:g} (compared as float32)")
        rank = len(layer.get_input(0).shape)
        expected = axes_mask(spec.axis, rank)
        if layer.axes != expected:
            problems.append(f"{where}: axes mask {layer.axes:#b} != {expected:#b} (axis {spec.axis} of a rank-{rank} input)")
        if getattr(layer, "num_groups", 1) != 1:
            problems.append(f"{where}: num_groups {layer.num_groups} != 1 (not a LayerNorm)")
    return problems
