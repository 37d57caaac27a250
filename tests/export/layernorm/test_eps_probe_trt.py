"""Eps probes on TensorRT: one-layer engines built ahead of time with TensorRT-RTX (no GPU needed),
their INormalizationLayer eps read back; running them needs a GPU and is skipped without one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ldlm.cli import main
from ldlm.export.engine_builder import BuildOptions, build_engines
from ldlm.export.graphs import graph_io
from ldlm.export.layernorm.trt_network import axes_mask, build_normalization_plan, parse_onnx_network, read_normalization_layers
from ldlm.export.layernorm.verify import LAYER_NORM_OP, pair_layer_norm_nodes
from ldlm.export.onnx_export import graph_layer_norm_specs
from ldlm.export.profiles import EngineProfile, ShapeRange
from ldlm.export.trt_flavor import load_flavor
from ldlm.serve.checks.eps_probe_artifact import probe_layer_norm_eps
from tests.artifacts import ENCODER_LN, edited_export, set_eps

pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install -e .[rtx]); no one-layer engine was built")
SMALL = (EngineProfile(ShapeRange(1, 2, 4), ShapeRange(1, 16, 64)),)
GPU = torch.cuda.is_available()
NOT_RUN_ON_CPU = (
    "no CUDA GPU: the one-layer TensorRT engines were not executed (deserialize_cuda_engine, "
    "execute_async_v3), so no implied eps, output check or fixed case ran on TensorRT"
)


@pytest.fixture(scope="module")
def engines(export_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("eps_engines") / "plans"
    build_engines(export_dir, out, BuildOptions(profiles=SMALL), flavor="tensorrt_rtx")
    return out


def layers_with_modules(onnx_path: Path, model, graph: str) -> list[tuple[object, str]]:
    import onnx

    flavor = load_flavor("tensorrt_rtx")
    _, network, _ = parse_onnx_network(flavor, onnx_path)
    nodes = [n for n in onnx.load(str(onnx_path), load_external_data=False).graph.node if n.op_type == LAYER_NORM_OP]
    module_of = {node.name: spec.name for node, spec in pair_layer_norm_nodes(nodes, graph_layer_norm_specs(model, graph_io(model, graph)))}
    return [(layer, module_of[layer.name]) for layer in read_normalization_layers(flavor.trt, network)]


def test_one_layer_plans_are_built_and_their_eps_read_back() -> None:
    flavor = load_flavor("tensorrt_rtx")
    scale, bias = np.linspace(0.5, 1.5, 64, dtype=np.float32), np.linspace(-0.1, 0.1, 64, dtype=np.float32)
    for eps in (1e-5, 1e-6, 1e-4):
        plan = build_normalization_plan(flavor, (1, 8, 64), axes_mask(-1, 3), eps, scale, bias)
        assert plan.epsilon == float(np.float32(eps)) and plan.axes == 0b100
        assert len(plan.plan) > 1000 and plan.input_shape == (1, 8, 64)
    two_axes = build_normalization_plan(flavor, (2, 2, 3), axes_mask(-2, 3), 1e-5, np.ones((2, 3), np.float32), None)
    assert two_axes.axes == 0b110


def test_parsed_layers_carry_each_modules_eps_scale_and_bias(export_dir: Path, tiny_model) -> None:
    for graph in ("encoder", "decoder"):
        pairs = layers_with_modules(export_dir / f"{graph}.onnx", tiny_model, graph)
        assert len(pairs) == 6
        for layer, module_name in pairs:
            module = tiny_model.get_submodule(module_name.removeprefix("model."))
            assert np.float32(layer.epsilon) == np.float32(module.eps) and layer.input_dtype == "FLOAT"
            np.testing.assert_array_equal(layer.scale, module.weight.detach().numpy())
            np.testing.assert_array_equal(layer.bias, module.bias.detach().numpy())


def test_engine_probes_build_every_layer_and_say_what_did_not_run(tiny_checkpoint: Path, engines: Path, capsys) -> None:
    report = probe_layer_norm_eps(tiny_checkpoint, engine_dir=engines)
    assert report.backend == "trt" and report.runtime.startswith("tensorrt_rtx")
    assert len(report.layer_norms) == 12 and not report.problems
    assert all(p.node_eps == float(np.float32(1e-5)) and not p.problems for p in report.layer_norms)
    assert len(report.cases) == 11  # float32 only: TensorRT takes no float64
    if GPU:
        assert report.passed, report.summary()
        return
    assert report.status == "NOT RUN" and not report.passed
    assert not any(p.ran for p in [*report.layer_norms, *report.cases])
    assert "no CUDA GPU" in report.not_exercised[0]
    with pytest.raises(SystemExit) as exit_:  # 3: not run, distinct from 0 passed and 1 failed
        main(["probe-eps", str(tiny_checkpoint), "--engine-dir", str(engines), "--quiet"])
    assert exit_.value.code == 3
    assert "not exercised: no CUDA GPU" in capsys.readouterr().out


def test_a_changed_eps_is_read_back_and_fails_naming_layer_and_module(
    tiny_checkpoint: Path, export_dir: Path, engines: Path, tiny_model, tmp_path: Path
) -> None:
    from ldlm.export.layernorm.eps_probe_trt import probe_layer

    broken = edited_export(export_dir, tmp_path / "broken", "encoder", set_eps(ENCODER_LN, 1e-6))
    flavor = load_flavor("tensorrt_rtx")
    probes = [
        probe_layer(flavor, "encoder", layer, module, tiny_model, 0, can_run=False)
        for layer, module in layers_with_modules(broken / "encoder.onnx", tiny_model, "encoder")
    ]
    [failed] = [p for p in probes if p.problems]
    assert failed.module == ENCODER_LN and failed.node_eps == pytest.approx(1e-6)
    assert f"layer {failed.node!r} (module {ENCODER_LN}): epsilon 1e-06 after parsing != module eps 1e-05" in failed.problems[0]
    # The engines were built from the intact export: the broken ONNX is refused as their source.
    report = probe_layer_norm_eps(tiny_checkpoint, onnx_dir=broken, engine_dir=engines)
    assert report.status == "FAILED" and any("encoder.onnx is not the ONNX encoder.plan was built from" in p for p in report.problems)


@pytest.mark.skipif(not GPU, reason=NOT_RUN_ON_CPU)
def test_engine_probes_pass_on_a_gpu(tiny_checkpoint: Path, engines: Path) -> None:
    report = probe_layer_norm_eps(tiny_checkpoint, engine_dir=engines)
    assert report.passed, report.summary()
    assert all(p.implied_eps_rel_error <= p.eps_rtol for p in report.layer_norms)
    assert all(c.passed for c in report.cases)
