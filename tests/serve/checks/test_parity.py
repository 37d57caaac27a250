"""The parity check: ONNX Runtime against eager on the tiny model, and a perturbed engine caught."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from ldlm.cli import main
from ldlm.export.artifact import read_manifest
from ldlm.export.layernorm.compare import Comparison, compare_outputs
from ldlm.export.layernorm.verify import LayerNormSpec, pair_layer_norm_nodes
from ldlm.serve.checks.parity import run_parity
from ldlm.serve.checks.parity_report import write_parity_report
from tests.artifacts import reseal_manifest

needs_ort = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime") is None, reason="ONNX Runtime is the engine under test (pip install -e .[cpu])"
)


def test_compare_outputs_rules() -> None:
    ref = np.array([[1.0, 2.0, 100.0], [0.0, -1.0, 3.0]])
    same = compare_outputs("same", ref, ref.copy(), atol=1e-5, rtol=1e-5)
    assert same.passed and same.max_abs == 0 and same.cosine_min == pytest.approx(1.0)
    # 0.5 off at 100: fails atol but passes rtol 1e-2, so the element passes (both must be exceeded).
    near = ref.copy()
    near[0, 2] += 0.5
    assert compare_outputs("near", ref, near, atol=1e-5, rtol=1e-2).passed
    far = compare_outputs("far", ref, near, atol=1e-5, rtol=1e-3)
    assert not far.passed and far.failed_elements == 1 and far.min_atol_to_pass == pytest.approx(0.5)
    nan = ref.copy()
    nan[1, 1] = np.nan
    result = compare_outputs("nan", ref, nan, atol=1e9, rtol=1e9)
    assert not result.passed and result.nonfinite_candidate == 1
    assert Comparison.from_dict(json.loads(json.dumps(far.to_dict()))) == far
    with pytest.raises(ValueError, match="nothing to compare"):
        compare_outputs("empty", np.zeros((0, 3)), np.zeros((0, 3)), 1e-5, 1e-5)
    with pytest.raises(ValueError, match="shape"):
        compare_outputs("shape", ref, ref[:1], 1e-5, 1e-5)


@needs_ort
def test_ort_parity_passes_with_full_token_agreement(tiny_checkpoint: Path, export_dir: Path, tmp_path: Path) -> None:
    report = run_parity(tiny_checkpoint, "ort", source=export_dir, bisect=True)
    assert report.passed, report.summary()
    assert report.token_agreement == 1.0
    assert {c.name.split("/")[0] for c in report.graphs} == {"encoder", "denoiser", "decoder"}
    assert any("stress-outliers" in c.name for c in report.graphs)
    assert len(report.layer_norms) == 2 * (6 + 0 + 6)  # two input sets x every LayerNorm
    assert all(p == "CPUExecutionProvider" for p in report.providers.values())
    assert report.first_divergence is None
    assert [v.graph for v in report.verification if v.passed] == ["encoder", "denoiser", "decoder"]
    assert report.eps_probes is not None and report.eps_probes.passed and len(report.eps_probes.layer_norms) == 12
    files = write_parity_report(report, tmp_path / "report")
    assert {f.name for f in files} == {"parity.json", "parity.md", "errors_by_graph.png", "errors_by_layernorm.png"}
    assert json.loads((tmp_path / "report" / "parity.json").read_text())["passed"] is True
    assert "PASSED parity ort (fp32)" in (tmp_path / "report" / "parity.md").read_text()


@needs_ort
def test_perturbed_layer_norm_is_caught_and_bisected(tiny_checkpoint: Path, export_dir: Path, tmp_path: Path, capsys) -> None:
    """One LayerNorm weight changed inside the ONNX: parity fails and bisect names that LayerNorm."""
    perturbed = tmp_path / "perturbed"
    shutil.copytree(export_dir, perturbed)
    model = onnx.load(str(perturbed / "decoder.onnx"))
    specs = [LayerNormSpec.from_dict(d) for d in read_manifest(export_dir)["graphs"]["decoder"]["layer_norms"]]
    nodes = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    node = next(n for n, spec in pair_layer_norm_nodes(nodes, specs) if spec.name == "model.token_decoder.blocks.0.attn_norm")
    scale = next(i for i in model.graph.initializer if i.name == node.input[1])
    weight = onnx.numpy_helper.to_array(scale).copy()
    weight[:8] *= 3.0
    model.graph.initializer.append(onnx.numpy_helper.from_array(weight, "perturbed_scale"))
    node.input[1] = "perturbed_scale"  # this node only, even if the exporter shared the initializer
    onnx.save(model, str(perturbed / "decoder.onnx"), save_as_external_data=True, location="decoder.onnx.data")
    reseal_manifest(perturbed, "decoder")  # past the sha256 check: the numbers must catch it

    report = run_parity(tiny_checkpoint, "ort", source=perturbed, bisect=True)
    assert not report.passed
    assert report.first_divergence is not None
    assert report.first_divergence.startswith("LayerNorm decoder:model.token_decoder.blocks.0.attn_norm"), report.first_divergence
    failing = [c.name for c in report.layer_norms if not c.passed]
    assert failing and all(name.startswith("decoder:") for name in failing)
    assert all(c.passed for c in report.graphs if not c.name.startswith("decoder/"))

    code = None
    try:
        main(["parity", str(tiny_checkpoint), "--onnx-dir", str(perturbed), "--bisect", "--out", str(tmp_path / "r")])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 1
    assert "first divergence: LayerNorm decoder:model.token_decoder.blocks.0.attn_norm" in capsys.readouterr().out


@needs_ort
def test_parity_bad_input(tiny_checkpoint: Path, export_dir: Path) -> None:
    with pytest.raises(ValueError, match="backend 'ort' cannot run precision='bf16'; allowed: fp32, fp16"):
        run_parity(tiny_checkpoint, "ort", "bf16", source=export_dir)
    with pytest.raises(ValueError, match="needs its engine directory"):
        run_parity(tiny_checkpoint, "trt")


def test_eager_parity_runs_the_checkpoint_without_an_artifact(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    """The torch backends have no artifact: no structural verifier, no eps probes, and the check runs (it used
    to look for a TensorRT plan in the checkpoint directory and fail)."""
    report = run_parity(tiny_checkpoint, "eager", steps=3)
    assert report.passed, report.summary()
    assert report.token_agreement == 1.0 and report.verification == [] and report.eps_probes is None
    assert {c.name.split("/")[0] for c in report.graphs} == {"encoder", "denoiser", "decoder"}
    assert all(c.max_abs == 0 for c in report.graphs)  # the same modules in the same precision on the same device
    assert "eager has no artifact: no structural verifier and no eps probes ran" in report.notes

    assert main(["parity", str(tiny_checkpoint), "--backend", "eager", "--steps", "3", "--quiet", "--out", str(tmp_path / "r")]) == 0
    assert "PASSED parity eager (fp32) vs eager" in capsys.readouterr().out
    saved = json.loads((tmp_path / "r" / "parity.json").read_text())
    assert saved["passed"] is True and saved["eps_probes"] is None and saved["verification"] == []


@needs_ort
def test_eps_probes_run_on_the_provider_asked_for(tiny_checkpoint: Path, export_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--provider reaches the eps probes, not only the graphs. Here the only provider besides CPU is Azure's
    (it places no node, so ONNX Runtime runs them on CPU), put under a provider name for this test."""
    import onnxruntime

    from ldlm.serve.runtime import ort_backend

    if "AzureExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has no second provider to ask for (AzureExecutionProvider)")
    monkeypatch.setitem(ort_backend.ORT_PROVIDERS, "azure", ("AzureExecutionProvider", "CPUExecutionProvider"))
    report = run_parity(tiny_checkpoint, "ort", source=export_dir, steps=2, provider="azure")
    assert set(report.providers.values()) == {"AzureExecutionProvider"}
    assert report.eps_probes is not None and report.eps_probes.runtime.endswith(" AzureExecutionProvider"), report.eps_probes.runtime
    assert report.eps_probes.passed


def test_compare_with_eager_scores_tokens_against_the_reference_given(tiny_model, tokenizer) -> None:
    """The shared levels 1 and 3 (run_parity and scripts/research/gpu_check.py): eager against itself agrees on
    every token; against a reference with 4 of its 16 tokens changed, on exactly 12 of 16."""
    from ldlm.export.graphs import GRAPH_NAMES
    from ldlm.serve.checks.parity_end_to_end import compare_with_eager, eager_tokens
    from ldlm.serve.runtime.torch_backends import EagerBackend

    graphs = {g: EagerBackend(tiny_model, g, with_logits=g == "decoder") for g in GRAPH_NAMES}
    report = compare_with_eager(tiny_model, tokenizer, graphs, "eager", "fp32", steps=2, n=2, length=8)
    assert report.passed and report.token_agreement == 1.0 and all(c.max_abs == 0 for c in report.graphs)
    reference = eager_tokens(tiny_model, tokenizer, 2, 8, 2, 0).clone()
    reference[0, :4] = (reference[0, :4] + 1) % tiny_model.config.vocab_size
    changed = compare_with_eager(tiny_model, tokenizer, graphs, "eager", "fp32", steps=2, n=2, length=8, reference_tokens=reference)
    assert changed.token_agreement == 12 / 16 and not changed.passed
