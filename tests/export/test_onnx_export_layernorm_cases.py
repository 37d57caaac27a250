"""The fixed LayerNorm cases (export/layernorm/cases.py) through OUR code: the MLP of ldlm/model/layers.py
(whose pre-norm is every LayerNorm of the latent encoder and decoder), exported by our exporter,
verified by our verifier, and run in ONNX Runtime; then every LayerNorm of the tiny model's exported
graphs. The reference is always NumPy (tests/reference.py), never torch."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from ldlm.export.artifact import read_manifest
from ldlm.export.graphs import GraphIO
from ldlm.export.layernorm.verify import LAYER_NORM_OP, LayerNormSpec, layer_norm_specs, pair_layer_norm_nodes, verify_onnx
from ldlm.export.onnx_export import export_graph
from ldlm.model.layers import MLP
from tests.reference import layer_norm as np_layer_norm

ort = pytest.importorskip("onnxruntime", reason="every case runs the exported graph (pip install -e .[cpu])")


def mlp(dim: int, eps: float = 1e-5, weight=None, bias=None, seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    module = MLP(dim, 2 * dim, eps=eps, dropout=0.0).eval()
    with torch.no_grad():
        if weight is not None:
            module.norm.weight.copy_(torch.as_tensor(np.asarray(weight, dtype=np.float32)))
        if bias is not None:
            module.norm.bias.copy_(torch.as_tensor(np.asarray(bias, dtype=np.float32)))
    return module


def np_mlp(module: MLP, x: np.ndarray) -> np.ndarray:
    """The whole MLP in NumPy float64: LayerNorm -> Linear -> exact GELU -> Linear."""
    p = {k: v.detach().double().numpy() for k, v in module.state_dict().items()}
    h = np_layer_norm(x, 1, p["norm.weight"], p["norm.bias"], eps=module.norm.eps) @ p["fc_in.weight"].T + p["fc_in.bias"]
    h = 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
    return h @ p["fc_out.weight"].T + p["fc_out.bias"]


class ChannelsFirst(nn.Module):
    """Case 6 the right way: NCHW -> NHWC -> our MLP's LayerNorm(C) -> NCHW."""

    def __init__(self, inner: MLP) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def export_with_norm_output(module: nn.Module, x: np.ndarray, path: Path) -> tuple[np.ndarray, np.ndarray, onnx.NodeProto]:
    """Export with our exporter, verify with our verifier, mark the LayerNorm's output as a graph
    output, run ONNX Runtime: (graph output, LayerNorm output, the node)."""
    x_t = torch.tensor(x, dtype=torch.float32)
    io = GraphIO(path.stem, module, (), (x_t,), ("x",), ("y",), (tuple(x.shape),), (tuple(x.shape),))
    export_graph(io, path, 18, max_seq_len=1, metadata={})
    result = verify_onnx(path, layer_norm_specs(module))
    assert result.passed and result.layer_norm_nodes == 1, result.summary()
    model = onnx.load(str(path))
    node = next(n for n in model.graph.node if n.op_type == LAYER_NORM_OP)
    model.graph.output.append(onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None))
    marked = path.with_name(path.stem + ".marked.onnx")
    onnx.save(model, str(marked))
    y, normed = ort.InferenceSession(str(marked), providers=["CPUExecutionProvider"]).run(None, {"x": x_t.numpy()})
    return y, normed, node


def eager_norm(module: nn.Module, norm: nn.LayerNorm, x: np.ndarray) -> np.ndarray:
    captured: dict[str, np.ndarray] = {}

    def keep(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
        captured["y"] = output.detach().numpy()

    hook = norm.register_forward_hook(keep)
    try:
        with torch.no_grad():
            module(torch.tensor(x, dtype=torch.float32))
    finally:
        hook.remove()
    return captured["y"]


F32 = dict(atol=2e-5, rtol=1e-5)  # float32 against a float64 reference (layernorm-cases.md, notes)

# case: (input, dim, eps, weight, bias, golden first row of the LayerNorm output or None)
CASES = {
    "1-last-axis": (
        np.array([[[1, 2, 4], [10, 20, 40]], [[3, 5, 9], [2, 3, 8]]], float),
        3,
        1e-5,
        [1, 1, 1],
        [0, 0, 0],
        [-1.069, -0.2673, 1.3363],
    ),
    "2-population-variance": (np.array([[1, 2, 4], [8, 8, 8]], float), 3, 1e-5, [1, 1, 1], [0, 0, 0], None),
    "3-affine": (np.array([[1, 2, 4], [2, 4, 8]], float), 3, 1e-5, [2, 0.5, -1], [1, -2, 3], None),
    "4-eps-1e-5": (np.array([[1, 1.001, 0.999], [7, 7, 7]], float), 3, 1e-5, [1, 1, 1], [0, 0, 0], [0.0, 0.306186, -0.306186]),
    "4-eps-0.1": (np.array([[1, 1.001, 0.999], [7, 7, 7]], float), 3, 0.1, [1, 1, 1], [0, 0, 0], [0.0, 0.003162, -0.003162]),
    "7-hand-written": (None, 128, 1e-5, None, None, None),
    "8-default-init": (np.array([[8, -3, 0, 1, 5, -2]], float), 6, 1e-5, None, None, [1.6830, -1.1651, -0.3884, -0.1295, 0.9062, -0.9062]),
}


def case_inputs(case: str):
    x, dim, eps, weight, bias, golden = CASES[case]
    if case == "7-hand-written":  # x = randn(4, 128) * 3 + 5 (seed 0), gamma = 1 + 0.1 randn, beta = 0.1 randn
        torch.manual_seed(0)
        x = (torch.randn(4, 128) * 3 + 5).double().numpy()
        weight, bias = (1 + 0.1 * torch.randn(128)).numpy(), (0.1 * torch.randn(128)).numpy()
    return x, dim, eps, weight, bias, golden


@pytest.mark.parametrize("case", sorted(CASES))
def test_case_through_our_mlp_and_its_exported_graph(case: str, tmp_path: Path) -> None:
    x, dim, eps, weight, bias, golden = case_inputs(case)
    module = mlp(dim, eps, weight, bias)
    x32 = x.astype(np.float32).astype(np.float64)  # the reference sees the same rounded input
    p = {k: v.detach().double().numpy() for k, v in module.norm.state_dict().items()}
    reference = np_layer_norm(x32, 1, p["weight"], p["bias"], eps=eps)

    eager = eager_norm(module, module.norm, x)
    y, normed, node = export_with_norm_output(module, x, tmp_path / "mlp.onnx")
    np.testing.assert_allclose(eager, reference, **F32)
    np.testing.assert_allclose(normed, reference, **F32)
    np.testing.assert_allclose(y, np_mlp(module, x32), atol=1e-4, rtol=1e-4)  # the whole module, not just its norm
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert np.float32(attrs.get("epsilon", 1e-5)) == np.float32(eps)  # the module's eps, not a default
    assert attrs.get("axis", -1) == -1
    assert len(node.input) == 3  # the MLP's norm has a weight and a bias: both are inputs of the node
    if golden is not None:
        np.testing.assert_allclose(normed.reshape(-1, dim)[0], golden, atol=1e-4)
    if case == "2-population-variance":
        np.testing.assert_array_equal(normed[1], np.zeros(3, np.float32))  # a constant row gives exact zeros
        v = 14 / 9
        np.testing.assert_allclose(normed[0].astype(np.float64).var(), v / (v + 1e-5), rtol=1e-5)
    if case == "3-affine":
        np.testing.assert_allclose(normed.mean(axis=-1), [-0.536, -0.536], atol=1e-3)
        assert sum(q.numel() for q in module.norm.parameters()) == 6


def test_case5_train_and_eval_agree_and_hold_no_statistics(tmp_path: Path) -> None:
    module = mlp(3, weight=[2, 0.5, -1], bias=[1, -2, 3])
    x = np.array([[1, 2, 4], [3, 7, 8]], float)
    evaluated = eager_norm(module.eval(), module.norm, x)
    trained = eager_norm(module.train(), module.norm, x)
    np.testing.assert_array_equal(evaluated, trained)
    assert list(module.norm.buffers()) == []
    _, normed, _ = export_with_norm_output(module.eval(), x, tmp_path / "mlp.onnx")
    np.testing.assert_allclose(normed, np_layer_norm(x, 1, np.array([2, 0.5, -1]), np.array([1, -2, 3])), **F32)


def test_case6_channels_first_through_our_norm(tmp_path: Path) -> None:
    module = ChannelsFirst(mlp(2, weight=[1, 1], bias=[0, 0]))
    x = np.arange(12, dtype=float).reshape(1, 2, 2, 3)
    y, normed, _ = export_with_norm_output(module, x, tmp_path / "channels.onnx")
    reference = np_layer_norm(x.transpose(0, 2, 3, 1), 1).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(y, reference, **F32)
    np.testing.assert_allclose(y[0, :, 0, 0], [-0.999999, 0.999999], atol=1e-5)  # first pixel: values 0 and 6
    assert normed.shape == (1, 2, 3, 2)  # the node saw NHWC: it normalized the channels


@pytest.mark.parametrize("graph", ["encoder", "decoder"])
def test_every_layer_norm_of_our_exported_graphs_matches_numpy(export_dir: Path, tiny_model, graph: str, tmp_path: Path) -> None:
    """Each LayerNormalization node of the exported graph, run in ONNX Runtime, against NumPy applied
    to that node's own input, with the parameters of the nn.LayerNorm it was exported from."""
    entry = read_manifest(export_dir)["graphs"][graph]
    specs = [LayerNormSpec.from_dict(d) for d in entry["layer_norms"]]
    model = onnx.load(str(export_dir / entry["file"]))
    nodes = [n for n in model.graph.node if n.op_type == LAYER_NORM_OP]
    pairs = pair_layer_norm_nodes(nodes, specs)
    assert len(pairs) == len(specs) == len(nodes) > 0
    for node, _ in pairs:
        for name in (node.input[0], node.output[0]):
            model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    marked = tmp_path / f"{graph}.marked.onnx"
    onnx.save(model, str(marked), save_as_external_data=True, location=marked.name + ".data")
    gen = np.random.default_rng(5)
    mask = np.ones((2, 9), dtype=np.int64)
    mask[1, 5:] = 0
    if graph == "encoder":
        feed = {"input_ids": gen.integers(0, 50257, (2, 9)), "attention_mask": mask}
    else:  # GPT-2-like outlier channels: a large mean and a small spread stress the variance
        latents = gen.standard_normal((2, 9, 64)).astype(np.float32)
        latents[:, :, [3, 17]] = 1000.0 + gen.standard_normal((2, 9, 2)).astype(np.float32)
        feed = {"latents": latents, "attention_mask": mask}
    names = [name for node, _ in pairs for name in (node.input[0], node.output[0])]
    values = dict(zip(names, ort.InferenceSession(str(marked), providers=["CPUExecutionProvider"]).run(names, feed)))
    for node, spec in pairs:
        module = tiny_model.get_submodule(spec.name.removeprefix("model."))
        assert isinstance(module, nn.LayerNorm) and np.float32(module.eps) == np.float32(1e-5)
        x = values[node.input[0]].astype(np.float64)
        reference = np_layer_norm(x, 1, module.weight.detach().double().numpy(), module.bias.detach().double().numpy(), module.eps)
        got = values[node.output[0]]
        scale = max(1.0, float(np.abs(reference).max()))
        assert np.abs(got - reference).max() <= 1e-4 * scale, (graph, spec.name)
