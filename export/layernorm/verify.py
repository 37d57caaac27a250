"""Structural verification of exported graphs: every nn.LayerNorm is one LayerNormalization node.

A numeric test cannot see a lost ``epsilon`` attribute (1e-5 is also the ONNX default), so the
graph is checked structurally against the modules it was exported from:
  - the count of LayerNormalization nodes equals the count of nn.LayerNorm modules;
  - each node's epsilon equals its module's eps, compared as float32;
  - each node's axis is -len(normalized_shape);
  - scale and bias initializers equal the module's weight and bias, and are absent (bias) or
    all ones (scale, which ONNX requires) where the module has none;
  - no decomposed LayerNorm (ReduceMean -> Sub -> Pow/Mul -> ReduceMean -> ...) appears;
  - no Q/DQ node feeds a LayerNorm, every LayerNorm reads and writes float32, and the graph is the
    precision its manifest says (``verify_quantized``);
  - onnx.checker's full check passes.
Nodes are paired with modules by name (the module path torch.onnx records on each node), never by
position, so a node reading another module's scale or bias fails.
"""

from __future__ import annotations

import ast
import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper
from torch import nn

from ldlm.export.layernorm.verify_quantized import LAYER_NORM_OP, check_precision_claim, check_quantized_layer_norms, graph_links

ONNX_DEFAULT_EPS = 1e-5
ONNX_DEFAULT_AXIS = -1


class VerificationError(ValueError):
    """An exported graph broke the LayerNorm promise; the message lists every problem."""


def eps_matches(eps: float, module_eps: float) -> bool:
    """Whether a LayerNorm's epsilon is its module's eps. Compared as float32, the only way an ONNX
    attribute or a TensorRT layer can hold it (1e-5 becomes 9.99999975e-06 in all of them)."""
    return bool(np.float32(eps) == np.float32(module_eps))


def config_eps_problems(specs: Iterable[LayerNormSpec], layer_norm_eps: float, config: str = "the config") -> list[str]:
    """Each spec whose eps is not ``layer_norm_eps``, the eps every nn.LayerNorm of the model is built with
    (``LDLMConfig.layer_norm_eps``): a record that disagrees with the config was edited, or is another model's."""
    return [
        f"module {s.name}: recorded eps {s.eps:g} != {config}'s layer_norm_eps {layer_norm_eps:g} (compared as float32)"
        for s in specs
        if not eps_matches(s.eps, layer_norm_eps)
    ]


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


@dataclass(frozen=True)
class LayerNormSpec:
    """What one nn.LayerNorm must become. ``name`` is the module path in the exported module."""

    name: str
    eps: float
    axis: int
    weight_sha256: str | None
    bias_sha256: str | None
    weight: np.ndarray | None = field(default=None, compare=False, repr=False)
    bias: np.ndarray | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("weight"), data.pop("bias")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerNormSpec:
        return cls(**data)


def layer_norm_specs(module: nn.Module, prefix: str = "") -> list[LayerNormSpec]:
    """The LayerNormSpec of every nn.LayerNorm in ``module``, in registration order."""
    specs = []
    for name, m in module.named_modules(prefix=prefix.rstrip(".")):
        if isinstance(m, nn.LayerNorm):
            weight = None if m.weight is None else m.weight.detach().cpu().numpy()
            bias = None if m.bias is None else m.bias.detach().cpu().numpy()
            specs.append(
                LayerNormSpec(
                    name=name,
                    eps=float(m.eps),
                    axis=-len(m.normalized_shape),
                    weight_sha256=None if weight is None else digest(weight),
                    bias_sha256=None if bias is None else digest(bias),
                    weight=weight,
                    bias=bias,
                )
            )
    return specs


@dataclass
class VerifyResult:
    """The outcome for one graph. ``problems`` holds every failure found, not just the first."""

    graph: str
    path: str
    layer_norm_nodes: int
    layer_norm_modules: int
    problems: list[str]

    @property
    def passed(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        status = "PASSED" if self.passed else "FAILED"
        head = f"{status} {self.graph}: {self.layer_norm_nodes} LayerNormalization node(s), {self.layer_norm_modules} expected"
        return "\n  - ".join([head, *self.problems])

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}

    def raise_for_problems(self) -> None:
        if self.problems:
            raise VerificationError(f"{self.path}: " + self.summary())


def verify_onnx(
    path: str | os.PathLike[str], expected: Sequence[LayerNormSpec], graph: str | None = None, precision: str = "fp32"
) -> VerifyResult:
    """Check the ONNX file at ``path`` against the LayerNorm modules it was exported from; ``precision``
    is what its manifest says it is (fp32, or int8 for a quantized variant)."""
    path = Path(path)
    name = graph or path.stem
    try:
        model = onnx.load(str(path))  # also loads external data from next to the file
    except Exception as error:  # onnx raises DecodeError, OSError, ...
        return VerifyResult(name, str(path), 0, len(expected), [f"cannot load {path}: {error}"])
    problems = check_layer_norms(model.graph, expected)
    problems += find_decomposed_layer_norms(model.graph)
    # types by shape inference, on the graph without its weights (cheap at any size)
    problems += check_quantized_layer_norms(onnx.load(str(path), load_external_data=False))
    problems += check_precision_claim(model.graph, precision)
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as error:  # ValidationError, InferenceError
        problems.append(f"onnx.checker full check failed: {str(error).strip().splitlines()[0]}")
    nodes = sum(1 for n in model.graph.node if n.op_type == LAYER_NORM_OP)
    return VerifyResult(name, str(path), nodes, len(expected), problems)


def check_layer_norms(graph: onnx.GraphProto, expected: Sequence[LayerNormSpec]) -> list[str]:
    nodes = [n for n in graph.node if n.op_type == LAYER_NORM_OP]
    problems = []
    if len(nodes) != len(expected):
        problems.append(
            f"{len(nodes)} LayerNormalization node(s) but {len(expected)} nn.LayerNorm module(s) "
            f"({', '.join(s.name for s in expected) or 'none'})"
        )
    tensors = _constant_tensors(graph)
    for node, spec in pair_layer_norm_nodes(nodes, expected):
        problems += _check_node(node, spec, tensors)
    return problems


def pair_layer_norm_nodes(nodes: list[onnx.NodeProto], specs: Sequence[LayerNormSpec]) -> list[tuple[onnx.NodeProto, LayerNormSpec]]:
    """Pair nodes with modules by name, never by position when a name is known.

    First by the module path torch.onnx's dynamo exporter records in each node's
    ``pkg.torch.onnx.name_scopes`` (so a node that reads another module's scale or bias is caught);
    then by scale initializer name (``<module>.weight``, for graphs without that metadata);
    whatever is left pairs in graph order, which is execution order.
    """
    by_name = {s.name: s for s in specs}
    by_weight = {f"{s.name}.weight": s for s in specs if s.weight_sha256 is not None}
    pairs, free_nodes = [], []
    used: set[str] = set()
    for node in nodes:
        spec = next((by_name[n] for n in reversed(node_name_scopes(node)) if n in by_name), None)
        if spec is None and len(node.input) > 1:
            spec = by_weight.get(node.input[1])
        if spec is not None and spec.name not in used:
            pairs.append((node, spec))
            used.add(spec.name)
        else:
            free_nodes.append(node)
    free_specs = [s for s in specs if s.name not in used]
    return pairs + list(zip(free_nodes, free_specs))


NAME_SCOPES_KEY = "pkg.torch.onnx.name_scopes"


def node_name_scopes(node: onnx.NodeProto) -> list[str]:
    """The module paths enclosing ``node`` (outermost first), as torch.onnx recorded them; [] if absent."""
    for prop in node.metadata_props:
        if prop.key == NAME_SCOPES_KEY:
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return []
            return [str(s) for s in scopes] if isinstance(scopes, list) else []
    return []


def _check_node(node: onnx.NodeProto, spec: LayerNormSpec, tensors: dict[str, np.ndarray]) -> list[str]:
    where = f"node {node.name or node.output[0]!r} (module {spec.name})"
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    problems = []
    eps = attrs.get("epsilon", ONNX_DEFAULT_EPS)
    if not eps_matches(eps, spec.eps):
        problems.append(f"{where}: epsilon {eps:g} != module eps {spec.eps:g} (compared as float32)")
    axis = attrs.get("axis", ONNX_DEFAULT_AXIS)
    if axis != spec.axis:
        problems.append(f"{where}: axis {axis} != {spec.axis} (-len(normalized_shape))")
    scale_name = node.input[1] if len(node.input) > 1 else ""
    bias_name = node.input[2] if len(node.input) > 2 else ""
    problems += _check_parameter(where, "scale", scale_name, spec.weight_sha256, spec.weight, tensors, absent_value=1.0)
    problems += _check_parameter(where, "bias", bias_name, spec.bias_sha256, spec.bias, tensors, absent_value=None)
    return problems


def _check_parameter(
    where: str,
    role: str,
    input_name: str,
    sha256: str | None,
    reference: np.ndarray | None,
    tensors: dict[str, np.ndarray],
    absent_value: float | None,
) -> list[str]:
    module_attr = "weight" if role == "scale" else "bias"
    if sha256 is None:  # the module has no such parameter
        if not input_name:
            return []
        value = tensors.get(input_name)
        if absent_value is not None and value is not None and np.all(value == absent_value):
            return []  # LayerNormalization requires a scale: all ones stands for "none"
        return [f"{where}: has a {role} input {input_name!r} but the module has no {module_attr}"]
    if not input_name:
        return [f"{where}: {role} input is missing but the module has a {module_attr}"]
    value = tensors.get(input_name)
    if value is None:
        return [f"{where}: {role} {input_name!r} is not an initializer or constant"]
    if digest(value) == sha256:
        return []
    detail = ""
    if reference is not None and reference.shape == value.shape:
        detail = f", max abs diff {np.abs(value.astype(np.float64) - reference.astype(np.float64)).max():.3g}"
    return [f"{where}: {role} {input_name!r} differs from the module's {module_attr}{detail}"]


def _constant_tensors(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    tensors = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    tensors[node.output[0]] = numpy_helper.to_array(attr.t)
    return tensors


def find_decomposed_layer_norms(graph: onnx.GraphProto) -> list[str]:
    """Find mean-centering followed by a variance: Sub(X, ReduceMean(X)) -> Pow/Mul -> ReduceMean.

    RMSNorm (Pow -> ReduceMean -> Add -> Sqrt, no centering) does not match.
    """
    producer, consumers = graph_links(graph)
    problems = []
    for node in graph.node:
        if node.op_type != "Sub" or len(node.input) != 2:
            continue
        x, mean = node.input
        mean_node = producer.get(mean)
        if mean_node is None or mean_node.op_type != "ReduceMean" or mean_node.input[0] != x:
            continue
        centered = node.output[0]
        squares = [c for c in consumers.get(centered, []) if _is_square(c, centered)]
        if any(c.op_type == "ReduceMean" for sq in squares for c in consumers.get(sq.output[0], [])):
            problems.append(
                f"decomposed LayerNorm: ReduceMean {mean_node.name!r} -> Sub {node.name!r} -> "
                f"{squares[0].op_type} -> ReduceMean; it must be one LayerNormalization node"
            )
    return problems


def _is_square(node: onnx.NodeProto, name: str) -> bool:
    if node.op_type == "Pow":
        return node.input[0] == name
    return node.op_type == "Mul" and list(node.input) == [name, name]


def verify_all(results: Iterable[VerifyResult]) -> list[VerifyResult]:
    """Raise one VerificationError naming every failing graph, or return the results."""
    results = list(results)
    failed = [r for r in results if not r.passed]
    if failed:
        raise VerificationError("\n".join(f"{r.path}: {r.summary()}" for r in failed))
    return results
