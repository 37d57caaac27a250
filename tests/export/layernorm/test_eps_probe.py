"""Eps probes: every LayerNorm run alone where eps decides, on ONNX Runtime (and TensorRT where it can).

The broken artifacts below are consistent ones (their manifest hashes are rewritten), as a buggy
exporter or builder would write them: only the probes and the structural verifier stand between
them and a passing parity.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from ldlm.cli import main
from ldlm.export.artifact import read_manifest
from ldlm.export.graphs import graph_io
from ldlm.export.layernorm.cases import layer_norm_cases
from ldlm.export.layernorm.eps_probe import (
    EpsProbeReport,
    LayerNormProbe,
    analyse_outputs,
    eps_rtol,
    probe_rows,
    run_cases,
)
from ldlm.export.layernorm.verify import check_layer_norms, node_name_scopes, pair_layer_norm_nodes, verify_onnx
from ldlm.export.onnx_export import graph_layer_norm_specs
from ldlm.model.checkpoint import init_model
from ldlm.model.layers import RMSNorm
from ldlm.serve.checks.eps_probe_artifact import probe_layer_norm_eps
from ldlm.serve.checks.parity import run_parity
from tests.artifacts import ENCODER_LN, edited_export, node_of, set_eps

ort = pytest.importorskip("onnxruntime", reason="ONNX Runtime is the backend under test (pip install -e .[cpu])")
from ldlm.export.layernorm.eps_probe_ort import OrtNodeRunner  # noqa: E402  (needs onnxruntime)

ENCODER_MLP_LN = "model.latent_encoder.blocks.0.mlp.norm"
DECODER_LN = "model.token_decoder.norm"
DECODER_MLP_LN = "model.latent_decoder.blocks.1.mlp.norm"


# --- helpers: consistent but wrong exports --------------------------------------------------------


def swap_parameters(first: str, second: str) -> Callable[[onnx.GraphProto], None]:
    """Node ``first`` reads ``second``'s scale and bias, and the other way round."""

    def edit(graph: onnx.GraphProto) -> None:
        a, b = node_of(graph, first), node_of(graph, second)
        a_params, b_params = list(a.input[1:]), list(b.input[1:])
        a.input[1:], b.input[1:] = b_params, a_params

    return edit


def failing(report: EpsProbeReport) -> list[LayerNormProbe]:
    return [p for p in report.layer_norms if p.problems]


# --- realistic norms -------------------------------------------------------------------------------


def test_norm_init_random_is_seeded_distinct_and_leaves_other_weights(tiny_config) -> None:
    model = init_model(tiny_config, seed=3, norm_init="random")
    again = init_model(tiny_config, seed=3, norm_init="random")
    default = init_model(tiny_config, seed=3)
    other_seed = init_model(tiny_config, seed=4, norm_init="random")
    norms = {n: m for n, m in model.named_modules() if isinstance(m, (torch.nn.LayerNorm, RMSNorm))}
    assert sum(isinstance(m, torch.nn.LayerNorm) for m in norms.values()) == 12
    assert sum(isinstance(m, RMSNorm) for m in norms.values()) > 10
    params = [p for m in norms.values() for p in (m.weight, getattr(m, "bias", None)) if p is not None]
    params += [model.feature_mean, model.feature_std, model.latent_mean, model.latent_std]
    first_values = [float(p.detach().reshape(-1)[0]) for p in params]
    assert len(set(first_values)) == len(first_values), "every norm parameter and statistic has its own values"
    for name, m in norms.items():
        assert not torch.all(m.weight == 1), name
        assert 0.5 < float(m.weight.detach().mean()) < 1.5, name
        if getattr(m, "bias", None) is not None:
            assert not torch.all(m.bias == 0) and float(m.bias.detach().abs().max()) < 1, name
    assert torch.all(model.feature_std > 0) and torch.all(model.latent_std > 0)
    assert not torch.all(model.feature_std == 1) and not torch.all(model.latent_mean == 0)
    for (name, p), (_, q), (_, r) in zip(model.state_dict().items(), again.state_dict().items(), default.state_dict().items()):
        assert torch.equal(p, q), f"{name}: same seed, same values"
        is_norm = name.rsplit(".", 1)[0] in norms or name.split(".")[0] in ("feature_mean", "feature_std", "latent_mean", "latent_std")
        if not is_norm:
            assert torch.equal(p, r), f"{name}: only norms and statistics change"
    assert not torch.equal(model.feature_mean, other_seed.feature_mean)
    with pytest.raises(ValueError, match="norm_init='ones' is unknown; allowed: default, random"):
        init_model(tiny_config, seed=0, norm_init="ones")


def test_cli_norm_init_random_and_loaded_gpt2_norms_are_kept(tmp_path: Path, tiny_config, capsys) -> None:
    from ldlm.model.checkpoint import load_checkpoint

    assert main(["init", str(tmp_path / "ckpt"), "--norm-init", "random", "--quiet"]) == 0
    assert "norm init random" in capsys.readouterr().out
    model, _ = load_checkpoint(tmp_path / "ckpt")
    assert not torch.all(model.token_decoder.norm.weight == 1) and not torch.all(model.latent_std == 1)
    transformers = pytest.importorskip("transformers", reason="transformers writes the local GPT-2 directory")
    hf = transformers.GPT2Model(
        transformers.GPT2Config(
            n_layer=tiny_config.gpt2_layers,
            n_embd=tiny_config.d_model,
            n_head=tiny_config.n_heads,
            vocab_size=tiny_config.gpt2_vocab_size,
            n_positions=tiny_config.gpt2_positions,
        )
    )
    with torch.no_grad():
        hf.h[0].ln_1.weight.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "gpt2")
    model = init_model(tiny_config, seed=0, gpt2_dir=tmp_path / "gpt2", norm_init="random")
    assert torch.equal(model.feature_model.h[0].ln_1.weight, hf.h[0].ln_1.weight), "trained GPT-2 norms are kept"
    assert not torch.all(model.latent_encoder.out_norm.weight == 1)


def test_exporter_keeps_one_initializer_per_module(export_dir: Path, tiny_model) -> None:
    for graph, entry in read_manifest(export_dir)["graphs"].items():
        proto = onnx.load(str(export_dir / entry["file"]), load_external_data=False)
        initializers = {t.name for t in proto.graph.initializer}
        specs = graph_layer_norm_specs(tiny_model, graph_io(tiny_model, graph))
        nodes = [n for n in proto.graph.node if n.op_type == "LayerNormalization"]
        assert len(nodes) == len(specs)
        used = [name for n in nodes for name in n.input[1:]]
        assert len(used) == len(set(used)) == 2 * len(specs), f"{graph}: every LayerNorm reads its own scale and bias"
        assert {f"{s.name}.{p}" for s in specs for p in ("weight", "bias")} == set(used)
        io = graph_io(tiny_model, graph)
        rms = [f"model.{c}.{n}.weight" for c in io.components for n, m in getattr(tiny_model, c).named_modules() if isinstance(m, RMSNorm)]
        assert set(rms) <= initializers, f"{graph}: every RMSNorm weight is its own initializer"


# --- the verifier pairs nodes with modules by name ------------------------------------------------


def test_verifier_pairs_nodes_with_modules_by_name_not_order(export_dir: Path, tiny_model, tmp_path: Path) -> None:
    specs = graph_layer_norm_specs(tiny_model, graph_io(tiny_model, "encoder"))
    proto = onnx.load(str(export_dir / "encoder.onnx"))
    nodes = [n for n in proto.graph.node if n.op_type == "LayerNormalization"]
    pairs = pair_layer_norm_nodes(list(reversed(nodes)), specs)
    assert all(spec.name in node_name_scopes(node) for node, spec in pairs)
    reordered = onnx.GraphProto()
    reordered.CopyFrom(proto.graph)
    del reordered.node[:]
    reordered.node.extend(list(reversed(proto.graph.node)))  # no longer topological: only pairing is checked
    assert check_layer_norms(reordered, specs) == []

    swapped = edited_export(export_dir, tmp_path / "swapped", "encoder", swap_parameters(ENCODER_LN, ENCODER_MLP_LN))
    result = verify_onnx(swapped / "encoder.onnx", specs, "encoder")
    assert not result.passed
    text = "\n".join(result.problems)
    assert f"(module {ENCODER_LN}): scale '{ENCODER_MLP_LN}.weight' differs from the module's weight" in text
    assert f"(module {ENCODER_MLP_LN}): bias '{ENCODER_LN}.bias' differs from the module's bias" in text


# --- ONNX Runtime probes ----------------------------------------------------------------------------


def test_correct_export_passes_with_implied_eps_of_every_layer_norm(tiny_checkpoint: Path, export_dir: Path, tmp_path: Path) -> None:
    report = probe_layer_norm_eps(tiny_checkpoint, onnx_dir=export_dir)
    assert report.passed and report.status == "PASSED", report.summary()
    assert len(report.layer_norms) == 12 and report.backend == "ort" and "CPUExecutionProvider" in report.runtime
    for probe in report.layer_norms:
        assert probe.module_eps == 1e-5 and probe.ran
        assert probe.implied_eps_rel_error is not None and probe.implied_eps_rel_error <= probe.eps_rtol == eps_rtol(64, 1e-5)
        assert probe.max_abs_error["constant"] < 1e-5 and probe.worst_error_over_bound <= 1
        assert f"| {probe.module} |" in report.table()
    assert len(report.cases) == 22 and all(c.passed for c in report.cases)
    assert EpsProbeReport.from_dict(json.loads(json.dumps(report.to_dict()))).to_dict() == report.to_dict()


@pytest.mark.parametrize(
    ("graph", "module", "eps"),
    [
        ("encoder", ENCODER_LN, 1e-6),
        ("encoder", ENCODER_MLP_LN, 1e-4),
        ("decoder", DECODER_LN, 1e-6),
        ("decoder", DECODER_MLP_LN, 1e-4),
    ],
)
def test_eps_changed_in_one_node_fails_naming_node_and_module(
    tiny_checkpoint: Path, export_dir: Path, tmp_path: Path, graph: str, module: str, eps: float
) -> None:
    broken = edited_export(export_dir, tmp_path / "broken", graph, set_eps(module, eps))
    report = probe_layer_norm_eps(tiny_checkpoint, onnx_dir=broken)
    assert not report.passed and report.status == "FAILED"
    [probe] = failing(report)
    assert (probe.graph, probe.module) == (graph, module)
    assert probe.implied_eps == pytest.approx(eps, rel=1e-3), "the implied eps is the node's, solved from its outputs"
    assert probe.node.startswith("node_layer_norm")
    assert f"node {probe.node!r} (module {module}): implied eps" in "\n".join(probe.problems)
    assert f"{graph}:{module} (node {probe.node})" in report.summary()


def test_scale_and_bias_swapped_between_two_layer_norms_fails(tiny_checkpoint: Path, export_dir: Path, tmp_path: Path) -> None:
    broken = edited_export(export_dir, tmp_path / "swapped", "decoder", swap_parameters(DECODER_LN, DECODER_MLP_LN))
    report = probe_layer_norm_eps(tiny_checkpoint, onnx_dir=broken)
    assert {p.module for p in failing(report)} == {DECODER_LN, DECODER_MLP_LN}
    for probe in failing(report):
        assert probe.implied_eps_rel_error <= probe.eps_rtol, "eps itself is right: the node's own scale isolates it"
        assert any("output differs from the module's LayerNorm" in p for p in probe.problems)


def test_seed_cases_pass_on_onnx_runtime_and_a_wrong_kernel_fails_them() -> None:
    runner = OrtNodeRunner(("CPUExecutionProvider",))
    results = run_cases(runner.run_case, ("float32", "float64"))
    assert len(results) == 2 * len(layer_norm_cases()) == 22
    assert all(r.passed for r in results), [(r.case, r.dtype, r.problems) for r in results if not r.passed]
    assert {r.case[0] for r in results} == set("12345678")
    # Planted: the same kernel with eps 10x too large fails the eps cases (and more: float32 tolerances).
    wrong = run_cases(lambda x, axis, s, b, eps: runner.run_case(x, axis, s, b, 10 * eps), ("float32",))
    assert {"4-eps-1e-5", "4-eps-0.1"} <= {r.case for r in wrong if not r.passed}
    # Planted: eps 0 turns the constant rows of cases 2 and 4 into 0/0.
    zero = {r.case: r for r in run_cases(lambda x, axis, s, b, eps: runner.run_case(x, axis, s, b, 0.0), ("float32",))}
    assert any("NaN/Inf" in p for p in zero["2-population-variance"].problems)


def test_implied_eps_solver_recovers_a_numpy_layer_norm_eps() -> None:
    """Outputs of an independent NumPy LayerNorm with eps 3e-6, rounded to float32: the solver
    must find 3e-6, and fail them against a module whose eps is 1e-5."""
    n = 96
    module = torch.nn.LayerNorm(n, eps=1e-5)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        module.weight.copy_(1 + 0.1 * torch.randn(n, generator=gen))
        module.bias.copy_(0.1 * torch.randn(n, generator=gen))
    g, b = module.weight.detach().numpy(), module.bias.detach().numpy()
    rows = probe_rows(n)
    for eps, passes in ((3e-6, False), (1e-5, True)):
        x = rows.x.astype(np.float64)
        centered = x - x.mean(axis=1, keepdims=True)
        y = (centered / np.sqrt((centered**2).mean(axis=1, keepdims=True) + eps) * g + b).astype(np.float32)
        probe = LayerNormProbe("g", "node", "m", 1e-5, eps, eps_rtol(n, 1e-5))
        analyse_outputs(probe, rows, y, g, b, module)
        assert probe.implied_eps == pytest.approx(eps, rel=1e-5)
        assert probe.passed is passes, probe.problems


# --- parity runs the verifier and the probes ------------------------------------------------------


def test_parity_fails_on_an_encoder_eps_of_1e6_that_whole_graphs_miss(tiny_checkpoint: Path, export_dir: Path, tmp_path: Path) -> None:
    broken = edited_export(export_dir, tmp_path / "broken", "encoder", set_eps(ENCODER_LN, 1e-6))
    report = run_parity(tiny_checkpoint, "ort", source=broken, bisect=True)
    assert report.token_agreement == 1.0 and all(c.passed for c in report.graphs), "the whole-graph checks cannot see it"
    assert all(c.passed for c in report.layer_norms), "nor the LayerNorm outputs inside the graph"
    assert report.first_divergence is not None
    assert report.first_divergence.startswith(f"LayerNorm encoder:{ENCODER_LN} run alone (eps probe, node node_layer_norm_3)")
    assert not report.passed
    assert report.eps_probes is not None and [p.module for p in failing(report.eps_probes)] == [ENCODER_LN]
    assert f"eps probes FAILED (encoder:{ENCODER_LN} (node " in report.summary()
    assert [v.graph for v in report.verification if not v.passed] == ["encoder"]  # the verifier sees it too
    assert json.loads(json.dumps(report.to_dict()))["eps_probes"]["passed"] is False


def test_parity_cli_fails_on_a_decoder_eps_of_1e4(tiny_checkpoint: Path, export_dir: Path, tmp_path: Path, capsys) -> None:
    broken = edited_export(export_dir, tmp_path / "broken", "decoder", set_eps(DECODER_MLP_LN, 1e-4))
    with pytest.raises(SystemExit) as exit_:
        main(["parity", str(tiny_checkpoint), "--onnx-dir", str(broken), "--out", str(tmp_path / "report"), "--bisect", "--quiet"])
    assert exit_.value.code == 1
    out = capsys.readouterr().out
    assert f"first divergence: LayerNorm decoder:{DECODER_MLP_LN}" in out
    assert f"(module {DECODER_MLP_LN}): implied eps 0.0001" in out
    assert "FAILED eps probes ort" in out and f"decoder:{DECODER_MLP_LN} (node node_layer_norm_2)" in out
    assert json.loads((tmp_path / "report" / "parity.json").read_text())["passed"] is False


def test_parity_fails_on_a_structural_verifier_failure_alone(tiny_checkpoint: Path, export_dir: Path, tmp_path: Path) -> None:
    """A dangling decomposed LayerNorm changes no output: only the structural verifier can fail it."""

    def add_decomposed(graph: onnx.GraphProto) -> None:
        make = onnx.helper.make_node
        graph.node.extend(
            [
                make("ReduceMean", ["latents"], ["dangling_mean"], name="dangling_mean"),
                make("Sub", ["latents", "dangling_mean"], ["dangling_centered"], name="dangling_sub"),
                make("Mul", ["dangling_centered", "dangling_centered"], ["dangling_sq"], name="dangling_sq"),
                make("ReduceMean", ["dangling_sq"], ["dangling_var"], name="dangling_var"),
            ]
        )

    broken = edited_export(export_dir, tmp_path / "broken", "decoder", add_decomposed)
    report = run_parity(tiny_checkpoint, "ort", source=broken)
    assert report.eps_probes is not None and report.eps_probes.passed
    assert all(c.passed for c in [*report.graphs, *report.layer_norms]) and report.token_agreement == 1.0
    assert not report.passed and "structural verifier FAILED: decoder" in report.summary()
    [failed] = [v for v in report.verification if not v.passed]
    assert "decomposed LayerNorm" in failed.problems[0]


def test_probe_eps_cli(tiny_checkpoint: Path, export_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["probe-eps", str(tiny_checkpoint), "--onnx-dir", str(export_dir), "--out", str(tmp_path / "p"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "PASSED eps probes ort" in out and f"| encoder | {ENCODER_LN} |" in out
    assert EpsProbeReport.from_dict(json.loads((tmp_path / "p" / "eps_probes.json").read_text())).passed
    assert main(["probe-eps", str(tiny_checkpoint)]) == 2
    assert "an artifact is needed; allowed: --onnx-dir DIR (ONNX Runtime) or --engine-dir DIR (TensorRT)" in capsys.readouterr().err
    assert main(["probe-eps", str(tiny_checkpoint), "--onnx-dir", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
