"""The graph verifier: the LayerNorm cases exported, verified and run in ONNX Runtime, and
deliberately broken graphs rejected with precise messages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from torch import nn

from ldlm.export.graphs import GraphIO
from ldlm.export.layernorm.verify import find_decomposed_layer_norms, layer_norm_specs, verify_onnx
from ldlm.export.onnx_export import export_graph
from tests.reference import layer_norm as np_layer_norm

# Only the tests that run a graph need ONNX Runtime; the structural checks run without it.
needs_ort = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime") is None, reason="ONNX Runtime runs the exported graphs (pip install -e .[cpu])"
)


class ChannelsLayerNorm(nn.Module):
    """Case 6: NCHW -> NHWC -> LayerNorm(C) -> NCHW."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels, elementwise_affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def affine(norm: nn.LayerNorm, weight: list[float], bias: list[float]) -> nn.LayerNorm:
    with torch.no_grad():
        norm.weight.copy_(torch.tensor(weight))
        norm.bias.copy_(torch.tensor(bias))
    return norm


def case7() -> tuple[nn.Module, np.ndarray]:
    torch.manual_seed(0)
    x = torch.randn(4, 128) * 3 + 5
    gamma, beta = 1 + 0.1 * torch.randn(128), 0.1 * torch.randn(128)
    return affine(nn.LayerNorm(128), gamma.tolist(), beta.tolist()), x.numpy()


# (case, module, input, NumPy reference, golden values at [first row] or None)
CASES = {
    "1-last-axis": (
        lambda: nn.LayerNorm(3, elementwise_affine=False),
        np.array([[[1, 2, 4], [10, 20, 40]], [[3, 5, 9], [2, 3, 8]]], float),
        lambda x, m: np_layer_norm(x, 1),
        [-1.069, -0.2673, 1.3363],
    ),
    "1-two-axes": (
        lambda: nn.LayerNorm((2, 3), elementwise_affine=False),
        np.array([[[1, 2, 4], [10, 20, 40]], [[3, 5, 9], [2, 3, 8]]], float),
        lambda x, m: np_layer_norm(x, 2),
        [-0.8612, -0.7884, -0.6429],
    ),
    "2-population-variance": (
        lambda: nn.LayerNorm(3, elementwise_affine=False),
        np.array([[1, 2, 4], [8, 8, 8]], float),
        lambda x, m: np_layer_norm(x, 1),
        None,
    ),
    "3-affine": (
        lambda: affine(nn.LayerNorm(3), [2, 0.5, -1], [1, -2, 3]),
        np.array([[1, 2, 4], [2, 4, 8]], float),
        lambda x, m: np_layer_norm(x, 1, np.array([2, 0.5, -1]), np.array([1, -2, 3])),
        None,
    ),
    "3-scale-only": (lambda: nn.LayerNorm(3, bias=False), np.array([[1, 2, 4], [2, 4, 8]], float), lambda x, m: np_layer_norm(x, 1), None),
    "4-eps-1e-5": (
        lambda: nn.LayerNorm(3, eps=1e-5, elementwise_affine=False),
        np.array([[1, 1.001, 0.999], [7, 7, 7]], float),
        lambda x, m: np_layer_norm(x, 1, eps=1e-5),
        [0.0, 0.306186, -0.306186],
    ),
    "4-eps-0.1": (
        lambda: nn.LayerNorm(3, eps=0.1, elementwise_affine=False),
        np.array([[1, 1.001, 0.999], [7, 7, 7]], float),
        lambda x, m: np_layer_norm(x, 1, eps=0.1),
        [0.0, 0.003162, -0.003162],
    ),
    "5-train-mode": (lambda: nn.LayerNorm(3).train(), np.array([[1, 2, 4], [3, 7, 8]], float), lambda x, m: np_layer_norm(x, 1), None),
    "6-channels": (
        lambda: ChannelsLayerNorm(2),
        np.arange(12, dtype=float).reshape(1, 2, 2, 3),
        lambda x, m: np_layer_norm(x.transpose(0, 2, 3, 1), 1).transpose(0, 3, 1, 2),
        None,
    ),
    "7-hand-written": (
        lambda: case7()[0],
        case7()[1].astype(float),
        lambda x, m: np_layer_norm(x, 1, m.weight.detach().double().numpy(), m.bias.detach().double().numpy()),
        None,
    ),
    "8-default-init": (
        lambda: nn.LayerNorm(6),
        np.array([[8, -3, 0, 1, 5, -2]], float),
        lambda x, m: np_layer_norm(x, 1),
        [1.6830, -1.1651, -0.3884, -0.1295, 0.9062, -0.9062],
    ),
}


def export_module(module: nn.Module, x: torch.Tensor, path: Path, opset: int = 18) -> None:
    io = GraphIO(path.stem, module, (), (x,), ("x",), ("y",), (tuple(x.shape),), (tuple(x.shape),))
    export_graph(io, path, opset, max_seq_len=1, metadata={})


def run_ort(path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@needs_ort
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_norm_case_exports_verifies_and_runs(case: str, dtype: torch.dtype, tmp_path: Path) -> None:
    make, x, reference, golden = CASES[case]
    module = make().to(dtype)
    x_t = torch.tensor(x, dtype=dtype)
    path = tmp_path / "case.onnx"
    export_module(module, x_t, path)
    result = verify_onnx(path, layer_norm_specs(module))
    assert result.passed, result.summary()
    assert result.layer_norm_nodes == 1
    got = run_ort(path, x_t.numpy())
    assert got.dtype == x_t.numpy().dtype
    # float32: the reference sees the same rounded input; the low-variance case 4 loses digits to
    # cancellation in any float32 variance, hence float32 tolerances (layernorm-cases.md, notes).
    atol = 1e-5 if dtype == torch.float32 else 1e-12
    np.testing.assert_allclose(got, reference(x_t.numpy().astype(np.float64), module), atol=atol)
    with torch.no_grad():
        np.testing.assert_allclose(got, module(x_t).numpy(), atol=atol)
    if golden is not None:
        np.testing.assert_allclose(got.reshape(-1, got.shape[-1])[0], golden, atol=1e-4)


@pytest.fixture(scope="module")
def mlp_graph(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    """The seed's MLP (LayerNorm -> Linear -> GELU -> Linear) with non-trivial norm parameters."""
    from ldlm.model.layers import MLP

    torch.manual_seed(0)
    mlp = MLP(16, 64, eps=1e-5, dropout=0.0)
    with torch.no_grad():
        mlp.norm.weight.normal_(1.0, 0.1)
        mlp.norm.bias.normal_(0.0, 0.1)
    path = tmp_path_factory.mktemp("mlp") / "mlp.onnx"
    export_module(mlp, torch.randn(2, 5, 16), path)
    return path, mlp


def broken(path: Path, tmp_path: Path, edit) -> Path:
    model = onnx.load(str(path))
    edit(model.graph)
    out = tmp_path / "broken.onnx"
    onnx.save(model, str(out))
    return out


def layer_norm_node(graph: onnx.GraphProto) -> onnx.NodeProto:
    return next(n for n in graph.node if n.op_type == "LayerNormalization")


def test_intact_graph_passes(mlp_graph) -> None:
    path, mlp = mlp_graph
    result = verify_onnx(path, layer_norm_specs(mlp))
    assert result.passed and result.summary().startswith("PASSED")


def test_changed_eps_is_rejected(mlp_graph, tmp_path: Path) -> None:
    path, mlp = mlp_graph

    def edit(graph):
        node = layer_norm_node(graph)
        for attr in node.attribute:
            if attr.name == "epsilon":
                attr.f = 1e-3

    result = verify_onnx(broken(path, tmp_path, edit), layer_norm_specs(mlp))
    assert not result.passed
    assert any("epsilon 0.001 != module eps 1e-05" in p for p in result.problems), result.problems


def test_dropped_eps_attribute_is_accepted_only_because_the_default_matches(mlp_graph, tmp_path: Path) -> None:
    """ONNX's default epsilon is 1e-5: a lost attribute is harmless for eps 1e-5, fatal for others."""
    path, mlp = mlp_graph

    def edit(graph):
        node = layer_norm_node(graph)
        keep = [a for a in node.attribute if a.name != "epsilon"]
        del node.attribute[:]
        node.attribute.extend(keep)

    dropped = broken(path, tmp_path, edit)
    assert verify_onnx(dropped, layer_norm_specs(mlp)).passed
    mlp.norm.eps = 1e-6
    try:
        result = verify_onnx(dropped, layer_norm_specs(mlp))
    finally:
        mlp.norm.eps = 1e-5
    assert any("epsilon" in p for p in result.problems)


def test_dropped_bias_is_rejected(mlp_graph, tmp_path: Path) -> None:
    path, mlp = mlp_graph

    def edit(graph):
        node = layer_norm_node(graph)
        inputs = list(node.input[:2])
        del node.input[:]
        node.input.extend(inputs)

    result = verify_onnx(broken(path, tmp_path, edit), layer_norm_specs(mlp))
    assert any("bias input is missing but the module has a bias" in p for p in result.problems), result.problems


def test_changed_scale_and_axis_are_rejected(mlp_graph, tmp_path: Path) -> None:
    path, mlp = mlp_graph

    def edit(graph):
        node = layer_norm_node(graph)
        for init in graph.initializer:
            if init.name == node.input[1]:
                values = onnx.numpy_helper.to_array(init).copy()
                values[3] += 0.5
                init.CopyFrom(onnx.numpy_helper.from_array(values, init.name))
        for attr in node.attribute:
            if attr.name == "axis":
                attr.i = -2

    problems = verify_onnx(broken(path, tmp_path, edit), layer_norm_specs(mlp)).problems
    assert any("scale" in p and "differs from the module's weight, max abs diff 0.5" in p for p in problems), problems
    assert any("axis -2 != -1" in p for p in problems), problems


@needs_ort
def test_decomposed_layer_norm_is_rejected(mlp_graph, tmp_path: Path) -> None:
    path, mlp = mlp_graph

    def edit(graph):
        node = layer_norm_node(graph)
        x, scale, bias = node.input
        y = node.output[0]
        two = helper.make_tensor("two", onnx.TensorProto.FLOAT, [], [2.0])
        eps = helper.make_tensor("eps", onnx.TensorProto.FLOAT, [], [1e-5])
        axes = helper.make_tensor("axes", onnx.TensorProto.INT64, [1], [-1])
        graph.initializer.extend([two, eps, axes])
        decomposed = [
            helper.make_node("ReduceMean", [x, "axes"], ["mu"], name="ln_mean"),
            helper.make_node("Sub", [x, "mu"], ["d"], name="ln_sub"),
            helper.make_node("Pow", ["d", "two"], ["d2"], name="ln_pow"),
            helper.make_node("ReduceMean", ["d2", "axes"], ["var"], name="ln_var"),
            helper.make_node("Add", ["var", "eps"], ["var_eps"], name="ln_add"),
            helper.make_node("Sqrt", ["var_eps"], ["std"], name="ln_sqrt"),
            helper.make_node("Div", ["d", "std"], ["xhat"], name="ln_div"),
            helper.make_node("Mul", ["xhat", scale], ["scaled"], name="ln_scale"),
            helper.make_node("Add", ["scaled", bias], [y], name="ln_bias"),
        ]
        index = list(graph.node).index(node)
        nodes = list(graph.node)
        nodes[index : index + 1] = decomposed
        del graph.node[:]
        graph.node.extend(nodes)

    bad = broken(path, tmp_path, edit)
    result = verify_onnx(bad, layer_norm_specs(mlp))
    assert any("0 LayerNormalization node(s) but 1 nn.LayerNorm module(s)" in p for p in result.problems)
    assert any("decomposed LayerNorm: ReduceMean 'ln_mean' -> Sub 'ln_sub'" in p for p in result.problems)
    # The decomposition is numerically the same; only the structural check sees it.
    x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
    np.testing.assert_allclose(run_ort(bad, x), run_ort(path, x), atol=1e-5)


def test_rmsnorm_is_not_taken_for_a_decomposed_layer_norm(tmp_path: Path) -> None:
    from ldlm.model.layers import RMSNorm

    path = tmp_path / "rms.onnx"
    export_module(RMSNorm(8, 1e-5), torch.randn(2, 8), path)
    assert find_decomposed_layer_norms(onnx.load(str(path)).graph) == []


def test_checker_failure_and_unreadable_file_are_reported(mlp_graph, tmp_path: Path) -> None:
    path, mlp = mlp_graph

    def edit(graph):
        graph.node.append(helper.make_node("Relu", ["no_such_tensor"], ["dangling"], name="dangling"))

    result = verify_onnx(broken(path, tmp_path, edit), layer_norm_specs(mlp))
    assert any("onnx.checker full check failed" in p for p in result.problems), result.problems
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00not onnx")
    assert any("cannot load" in p for p in verify_onnx(garbage, layer_norm_specs(mlp)).problems)
