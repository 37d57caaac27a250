"""The network-level LayerNorm check, seen through TensorRT-RTX's real parser: every rule it
enforces (count, epsilon, axes, num_groups) is broken once on a parsed network and must be named;
the build refuses a LayerNorm overflow warning; the manifest reads strong typing off the network;
one logger per flavour serves every builder and runtime; the build's progress bar appears."""

from __future__ import annotations

import contextlib
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ldlm.export.engine_builder import BuildOptions, build_plan
from ldlm.export.layernorm.trt_network import check_network_layer_norms, normalization_layers, parse_onnx_network
from ldlm.export.layernorm.verify import LayerNormSpec, digest
from ldlm.export.profiles import EngineProfile, ShapeRange
from ldlm.export.trt_flavor import EngineBuildError, flavor_logger, is_strongly_typed, load_flavor

pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install -e .[rtx]); no network was parsed")
SMALL = (EngineProfile(ShapeRange(1, 1, 2), ShapeRange(1, 8, 16)),)


@pytest.fixture(scope="module")
def flavor():
    return load_flavor("tensorrt_rtx")


def layer_norm_chain(path: Path, count: int = 4) -> tuple[list[LayerNormSpec], dict]:
    """x (batch, seq, 8) -> ``count`` x [LayerNormalization -> Relu] -> y, built with onnx.helper (no
    exporter, so this file stays fast); the specs are what the modules would have said."""
    gen = np.random.default_rng(0)
    nodes, inits, specs, last = [], [], [], "x"
    for i in range(count):
        weight = (1 + 0.1 * gen.standard_normal(8)).astype(np.float32)
        bias = (0.1 * gen.standard_normal(8)).astype(np.float32)
        inits += [numpy_helper.from_array(weight, f"ln{i}.weight"), numpy_helper.from_array(bias, f"ln{i}.bias")]
        nodes += [
            helper.make_node("LayerNormalization", [last, f"ln{i}.weight", f"ln{i}.bias"], [f"n{i}"], axis=-1, epsilon=1e-5, name=f"ln{i}"),
            helper.make_node("Relu", [f"n{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        specs.append(LayerNormSpec(f"ln{i}", 1e-5, -1, digest(weight), digest(bias), weight, bias))
        last = f"r{i}"
    shape = ["batch", "seq", 8]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(last, TensorProto.FLOAT, shape)],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    io = [{"name": "x", "dtype": "FLOAT", "shape": shape}]
    return specs, {"inputs": io, "outputs": [{**io[0], "name": last}]}


def test_each_network_rule_is_enforced(flavor, tmp_path: Path) -> None:
    trt = flavor.trt
    specs, _ = layer_norm_chain(tmp_path / "chain.onnx")
    keep = parse_onnx_network(flavor, tmp_path / "chain.onnx")  # the builder and parser own the network: keep them alive
    network = keep[1]
    layers = normalization_layers(trt, network)
    assert len(layers) == len(specs) == 4
    assert check_network_layer_norms(trt, network, specs) == []

    # count: one spec fewer, or one more, than there are layers
    fewer = check_network_layer_norms(trt, network, specs[:-1])
    assert any("4 INormalizationLayer(s) after parsing, 3 LayerNormalization node(s) expected" in p for p in fewer), fewer
    more = check_network_layer_norms(trt, network, [*specs, specs[0]])
    assert any("4 INormalizationLayer(s) after parsing, 5" in p for p in more), more

    # axes: the layer normalizes the last two axes of a rank-3 input instead of the last one
    layers[1].axes = 0b110
    problems = check_network_layer_norms(trt, network, specs)
    assert len(problems) == 1 and "axes mask 0b110 != 0b100" in problems[0], problems
    layers[1].axes = 0b100

    # num_groups: a GroupNorm is not a LayerNorm
    layers[2].num_groups = 2
    problems = check_network_layer_norms(trt, network, specs)
    assert len(problems) == 1 and "num_groups 2 != 1" in problems[0], problems
    layers[2].num_groups = 1

    # epsilon: the layer's, not the ONNX default's
    layers[0].epsilon = 1e-6
    problems = check_network_layer_norms(trt, network, specs)
    assert len(problems) == 1 and "epsilon 1e-06 != module eps 1e-05" in problems[0], problems
    layers[0].epsilon = 1e-5
    assert check_network_layer_norms(trt, network, specs) == []


def test_layer_norm_overflow_warning_fails_the_build(flavor, tmp_path: Path, monkeypatch) -> None:
    """TensorRT prints this warning when a LayerNorm arrived decomposed in FP16. The real builder runs;
    only the warning is injected into the build's log, as TensorRT would write it."""
    logger = flavor_logger(flavor)
    real_capture = logger.capture

    @contextlib.contextmanager
    def capture_with_warning():
        with real_capture() as messages:
            logger.log(
                flavor.trt.ILogger.Severity.WARNING,
                "Detected layernorm nodes in FP16. Running layernorm after self-attention in FP16 may cause overflow.",
            )
            yield messages

    specs, entry = layer_norm_chain(tmp_path / "chain.onnx", count=2)
    manifest = build_plan(flavor, tmp_path / "chain.onnx", tmp_path / "clean.plan", entry, specs, SMALL, BuildOptions())
    assert manifest["layer_norms"] == 2 and (tmp_path / "clean.plan").stat().st_size > 0  # without the warning: built
    monkeypatch.setattr(logger, "capture", capture_with_warning)
    with pytest.raises(EngineBuildError, match="LayerNorm FP16 overflow"):
        build_plan(flavor, tmp_path / "chain.onnx", tmp_path / "chain.plan", entry, specs, SMALL, BuildOptions())
    assert not (tmp_path / "chain.plan").exists()


def test_strongly_typed_is_read_from_the_network(flavor, tmp_path: Path) -> None:
    trt = flavor.trt
    layer_norm_chain(tmp_path / "chain.onnx", count=1)
    keep = parse_onnx_network(flavor, tmp_path / "chain.onnx")  # the builder and parser own the network: keep them alive
    network = keep[1]
    assert is_strongly_typed(trt, network) is True  # TensorRT-RTX: every network is strongly typed
    weak = types.SimpleNamespace(get_flag=lambda flag: False)  # what a weakly typed TensorRT network answers
    assert is_strongly_typed(trt, weak) is False
    no_flag = types.SimpleNamespace(NetworkDefinitionCreationFlag=types.SimpleNamespace())  # a TensorRT without the flag
    assert is_strongly_typed(no_flag, weak) is False


def test_one_logger_per_flavor_serves_every_builder_and_runtime(flavor, tmp_path: Path, monkeypatch) -> None:
    """TensorRT keeps the first logger it is given and warns for each different one; the history
    a long-running server keeps is capped; a capture sees only its own block's messages."""
    from ldlm.export import trt_flavor
    from ldlm.export.layernorm.trt_network import build_normalization_plan

    trt = flavor.trt
    given: list[object] = []
    real_builder = trt.Builder

    def recording_builder(logger):
        given.append(logger)
        return real_builder(logger)

    monkeypatch.setattr(trt, "Builder", recording_builder)
    specs, entry = layer_norm_chain(tmp_path / "chain.onnx", count=1)
    build_plan(flavor, tmp_path / "chain.onnx", tmp_path / "chain.plan", entry, specs, SMALL, BuildOptions())
    parse_onnx_network(flavor, tmp_path / "chain.onnx")
    build_normalization_plan(flavor, (2, 8), 2, 1e-5, np.ones(8, np.float32), None)
    assert len(given) == 3 and all(logger is flavor_logger(flavor) for logger in given)
    assert flavor_logger(load_flavor(flavor.name)) is flavor_logger(flavor)

    logger = flavor_logger(flavor)
    with logger.capture() as mine:
        for i in range(trt_flavor.LOG_HISTORY + 50):
            logger.log(trt.ILogger.Severity.WARNING, f"message {i}")
    logger.log(trt.ILogger.Severity.ERROR, "after the block")
    logger.log(trt.ILogger.Severity.INFO, "below the threshold")
    assert len(logger.messages) == trt_flavor.LOG_HISTORY and logger.messages[-1] == ("ERROR", "after the block")
    assert len(mine) == trt_flavor.LOG_HISTORY + 50 and mine[0] == ("WARNING", "message 0")

    with logger.capture() as outer:  # nested (or concurrent) captures: each keeps its own messages
        with logger.capture() as inner:
            pass  # both still empty, so equal lists: the inner's exit must not end the outer
        logger.log(trt.ILogger.Severity.WARNING, "after the inner capture")
    assert outer == [("WARNING", "after the inner capture")] and inner == []


def test_build_progress_bar_follows_tensorrt_phases(flavor, tmp_path: Path, monkeypatch, capsys) -> None:
    """TensorRT calls phase_start(phase_name, parent_phase, num_steps): top-level phases (no parent)
    get the bar, so it appears on stderr during a real build."""
    import ldlm.export.engine_builder as engine

    monitors = []
    real = engine.BuildProgress

    def recorded(trt, label, show):
        monitors.append(real(trt, label, show))
        return monitors[-1]

    monkeypatch.setattr(engine, "BuildProgress", recorded)
    specs, entry = layer_norm_chain(tmp_path / "chain.onnx", count=1)
    build_plan(flavor, tmp_path / "chain.onnx", tmp_path / "chain.plan", entry, specs, SMALL, BuildOptions(), progress=True)
    (monitor,) = monitors
    top = [name for name, parent, steps in monitor.phases if parent is None]
    assert top and all(steps > 0 for _, _, steps in monitor.phases)
    nested = [(name, parent) for name, parent, _ in monitor.phases if parent is not None]
    assert all(parent in {n for n, _, _ in monitor.phases} for _, parent in nested)
    assert f"chain: {top[0][:40]}" in capsys.readouterr().err
