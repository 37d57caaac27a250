"""ParityReport's verdict, rule by rule, on hand-made comparisons: every failing part fails the
whole, and nothing compared is no pass (no model or runtime needed)."""

from __future__ import annotations

import numpy as np
import pytest

from ldlm.export.layernorm.compare import compare_outputs
from ldlm.export.layernorm.eps_probe import EpsProbeReport
from ldlm.export.layernorm.verify import VerifyResult
from ldlm.serve.checks.parity_result import ParityReport, first_divergence

REF = np.array([[1.0, 2.0, 3.0]])


def comparison(name: str, error: float):
    return compare_outputs(name, REF, REF + error, atol=1e-4, rtol=1e-4)


def report(**overrides) -> ParityReport:
    fields = dict(
        backend="ort",
        precision="fp32",
        providers={},
        atol=1e-4,
        rtol=1e-4,
        graphs=[comparison("encoder/random/latents", 0.0), comparison("decoder/random/logits", 0.0)],
        layer_norms=[comparison("encoder:ln_a/random", 0.0), comparison("encoder:ln_b/random", 0.0)],
        decoder_token_agreement={"random": 1.0, "padded": 1.0},
        token_agreement=1.0,
        token_agreement_required=1.0,
    )
    fields.update(overrides)
    return ParityReport(**fields)  # type: ignore[arg-type]


def test_all_parts_agreeing_passes() -> None:
    good = report()
    assert good.passed and good.summary().startswith("PASSED")
    assert good.to_dict()["passed"] is True


@pytest.mark.parametrize(
    "case", ["graph", "layer_norm", "end_to_end", "end_to_end_missing", "decoder_tokens", "nothing", "structure", "eps_probes"]
)
def test_each_failing_part_fails_the_report(case: str) -> None:
    bad = {
        "graph": dict(graphs=[comparison("encoder/random/latents", 0.0), comparison("decoder/random/logits", 1e-2)]),
        "layer_norm": dict(layer_norms=[comparison("encoder:ln_a/random", 0.0), comparison("encoder:ln_b/random", 1e-2)]),
        "end_to_end": dict(token_agreement=0.99),
        "end_to_end_missing": dict(token_agreement=None),
        "decoder_tokens": dict(decoder_token_agreement={"random": 1.0, "padded": 0.75}),
        "nothing": dict(graphs=[], layer_norms=[]),
        # the artifact's structure and its eps probes count on their own: an engine whose builder changed
        # an eps passes every whole-graph comparison (eps barely moves ordinary activations)
        "structure": dict(verification=[VerifyResult("encoder", "encoder.onnx", 2, 2, ["epsilon 1e-06 != module eps 1e-05"])]),
        "eps_probes": dict(
            verification=[VerifyResult("encoder", "encoder.onnx", 2, 2, [])],
            eps_probes=EpsProbeReport("trt", "tensorrt", "engines", problems=["encoder.ln_a: implied eps 1e-06"]),
        ),
    }[case]
    failed = report(**bad)
    assert not failed.passed, case
    assert failed.summary().startswith("FAILED") and failed.to_dict()["passed"] is False


def test_lower_precision_requirement_is_a_threshold() -> None:
    assert report(token_agreement=0.9, token_agreement_required=0.9, decoder_token_agreement={"random": 0.95}).passed
    assert not report(token_agreement=0.89, token_agreement_required=0.9).passed


def test_first_divergence_names_the_first_failing_layer_norm() -> None:
    layer_norms = [comparison("encoder:ln_a/random", 0.0), comparison("encoder:ln_b/random", 5e-3), comparison("encoder:ln_c/random", 1.0)]
    found = first_divergence(report(layer_norms=layer_norms))
    assert found.startswith("LayerNorm encoder:ln_b (max abs 0.005 > atol 0.0001)"), found
    graph_only = first_divergence(report(graphs=[comparison("denoiser/random/x0_hat", 1.0)]))
    assert graph_only.startswith("graph denoiser: no LayerNorm output diverged"), graph_only
