"""The structural verifier on graphs built by hand (no exporter, no runtime): each rule broken once,
and a correct graph passing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ldlm.export.layernorm.verify import LayerNormSpec, check_layer_norms, digest, verify_onnx

GEN = np.random.default_rng(0)
W = [(1 + 0.1 * GEN.standard_normal(4)).astype(np.float32) for _ in range(2)]
B = [(0.1 * GEN.standard_normal(4)).astype(np.float32) for _ in range(2)]


def spec(i: int, eps: float = 1e-5, weight: bool = True, bias: bool = True) -> LayerNormSpec:
    return LayerNormSpec(
        f"ln{i}",
        eps,
        -1,
        digest(W[i]) if weight else None,
        digest(B[i]) if bias else None,
        W[i] if weight else None,
        B[i] if bias else None,
    )


def graph(
    nodes_inputs: list[list[str]], eps: list[float] | None = None, initializers: dict[str, np.ndarray] | None = None
) -> onnx.GraphProto:
    inits = {f"ln{i}.weight": W[i] for i in range(2)} | {f"ln{i}.bias": B[i] for i in range(2)} | (initializers or {})
    nodes, last = [], "x"
    for i, extra in enumerate(nodes_inputs):
        nodes.append(
            helper.make_node(
                "LayerNormalization", [last, *extra], [f"y{i}"], axis=-1, epsilon=(eps or [1e-5] * len(nodes_inputs))[i], name=f"node{i}"
            )
        )
        last = f"y{i}"
    return helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info(last, TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )


def test_correct_graph_passes(tmp_path: Path) -> None:
    g = graph([["ln0.weight", "ln0.bias"], ["ln1.weight", "ln1.bias"]])
    assert check_layer_norms(g, [spec(0), spec(1)]) == []
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    result = verify_onnx(path, [spec(0), spec(1)])
    assert result.passed and result.layer_norm_nodes == 2 and result.layer_norm_modules == 2


def test_more_nodes_than_modules_is_a_problem() -> None:
    problems = check_layer_norms(graph([["ln0.weight", "ln0.bias"], ["ln1.weight", "ln1.bias"]]), [spec(0)])
    assert any("2 LayerNormalization node(s) but 1 nn.LayerNorm module(s) (ln0)" in p for p in problems), problems


def test_swapped_parameters_are_caught_by_value() -> None:
    """Right names, wrong values: ln0's weight holds ln1's numbers."""
    problems = check_layer_norms(
        graph([["ln0.weight", "ln0.bias"], ["ln1.weight", "ln1.bias"]], initializers={"ln0.weight": W[1]}), [spec(0), spec(1)]
    )
    diff = float(np.abs(W[1] - W[0]).max())
    assert problems == [f"node 'node0' (module ln0): scale 'ln0.weight' differs from the module's weight, max abs diff {diff:.3g}"], (
        problems
    )


def test_parameters_the_module_does_not_have() -> None:
    ones = {"ones": np.ones(4, np.float32), "twos": np.full(4, 2.0, np.float32)}
    # no bias in the module, one in the graph
    problems = check_layer_norms(graph([["ln0.weight", "ln0.bias"]]), [spec(0, bias=False)])
    assert any("has a bias input 'ln0.bias' but the module has no bias" in p for p in problems), problems
    # no weight in the module: an all-ones scale stands for none; anything else is a weight
    assert check_layer_norms(graph([["ones"]], initializers=ones), [spec(0, weight=False, bias=False)]) == []
    problems = check_layer_norms(graph([["twos"]], initializers=ones), [spec(0, weight=False, bias=False)])
    assert any("has a scale input 'twos' but the module has no weight" in p for p in problems), problems
    # a weight in the module, but the graph's node has no bias
    problems = check_layer_norms(graph([["ln0.weight"]]), [spec(0)])
    assert any("bias input is missing but the module has a bias" in p for p in problems), problems


def test_eps_compared_as_float32_per_node() -> None:
    g = graph([["ln0.weight", "ln0.bias"], ["ln1.weight", "ln1.bias"]], eps=[1e-5, 1e-6])
    problems = check_layer_norms(g, [spec(0), spec(1)])
    assert len(problems) == 1 and "epsilon 1e-06 != module eps 1e-05" in problems[0], problems
    # 1e-5 stored as float32 is 9.99999974738e-06: equal to the module's 1e-5 as float32
    assert check_layer_norms(graph([["ln0.weight", "ln0.bias"]], eps=[float(np.float32(1e-5))]), [spec(0)]) == []
