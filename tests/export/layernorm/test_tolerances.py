"""Each precision's parity gate, stated where a user reads it (``ldlm parity --help``, the report and its
FAILED line): an int8 report has no "atol inf" anywhere, and a token agreement below the gate names the
figure, the gate and the ways out. Hand-made comparisons and reports; no model or runtime."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from ldlm.cli import build_parser  # noqa: E402
from ldlm.export.layernorm.compare import Comparison, compare_outputs  # noqa: E402
from ldlm.export.layernorm.tolerances import gates_help  # noqa: E402
from ldlm.serve.checks.parity_report import _plot_layer_norms, markdown  # noqa: E402
from ldlm.serve.checks.parity_result import ParityReport, first_divergence  # noqa: E402

# the gates as the project states them, written out by hand
GATES = {
    "fp32": "fp32: each element within atol 0.0001 or rtol 0.0001, token agreement >= 100%",
    "fp16": "fp16: each element within atol 0.02 or rtol 0.02, token agreement >= 90%",
    "bf16": "bf16: each element within atol 0.1 or rtol 0.05, token agreement >= 80%",
    "int8": "int8: cosine per sample >= 0.999 (no elementwise bound), token agreement >= 99%",
}
REF = np.linspace(-1, 1, 64).reshape(2, 32)


def int8_comparison(name: str, tilt: float) -> Comparison:
    """An int8 comparison (no elementwise bound, cosine >= 0.999) of an output turned away from REF by ``tilt``."""
    candidate = REF + tilt * np.cos(np.arange(64)).reshape(2, 32)
    return compare_outputs(name, REF, candidate, math.inf, math.inf, 0.999)


def int8_report(tokens: float | None, decoder: float = 1.0, tilt: float = 1e-3) -> ParityReport:
    graphs = [int8_comparison("denoiser/random/x0_hat", tilt)]
    norms = [int8_comparison("decoder:model.token_decoder.norm/random", tilt)]
    return ParityReport("ort", "int8", {}, math.inf, math.inf, graphs, norms, {"random": decoder}, tokens, 0.99)


def test_the_gates_are_stated_per_precision_in_the_help() -> None:
    assert gates_help() == "; ".join(GATES.values())
    parity = build_parser()._subparsers._group_actions[0].choices["parity"]  # type: ignore[union-attr]
    text = " ".join(parity.format_help().split())  # argparse wraps lines
    assert all(gate in text for gate in GATES.values()), text
    assert "atol inf" not in text and "--min-token-agreement SHARE" in text


def test_an_int8_comparison_says_it_has_no_elementwise_bound() -> None:
    close, turned = int8_comparison("denoiser/random/x0_hat", 1e-3), int8_comparison("denoiser/padded/x0_hat", 0.1)
    assert close.passed and not turned.passed
    for c in (close, turned):
        assert "atol inf" not in c.summary() and f"no elementwise bound ({c.elements} elements judged by cosine)" in c.summary()
    assert f"cosine min {turned.cosine_min:.6f} < 0.999 required" in turned.summary() and turned.cosine_min < 0.999
    assert f"cosine min {close.cosine_min:.6f} >= 0.999 required" in close.summary()
    fp32 = compare_outputs("encoder/random/latents", REF, REF + 1e-3, 1e-4, 1e-4)
    assert "64/64 elements over atol 0.0001 and rtol 0.0001" in fp32.summary() and "required" not in fp32.summary()
    assert Comparison.from_dict({k: v for k, v in fp32.to_dict().items() if k != "cosine_at_least"}) == fp32  # reports written before


def test_an_int8_token_shortfall_names_the_figure_the_gate_and_the_ways_out() -> None:
    """96.875%: the shipped checkpoint's int8 figure. The decoder's tokens agree, so the denoiser costs them."""
    lost = int8_report(0.96875)
    line = lost.summary()
    assert line.startswith("FAILED parity ort (int8) vs eager")
    assert "token agreement 96.88% is below the int8 gate of 99%; to accept it, pass --min-token-agreement 0.96" in line
    assert "or keep fp32 for the graph that costs the tokens, the denoiser" in line and "--min-cosine" in line
    by_decoder = int8_report(1.0, decoder=0.95).summary()
    assert "decoder token ids 95.00% is below the int8 gate of 99%" in by_decoder
    assert (
        "the decoder (its token ids agree 95.00% on its own inputs): export with --quantize int8 --quantize-graphs denoiser" in by_decoder
    )
    assert int8_report(0.995).passed and int8_report(0.995).token_shortfall() is None
    fp16 = ParityReport("ort", "fp16", {}, 2e-2, 2e-2, lost.graphs, [], {}, 0.85, 0.9).summary()
    assert "token agreement 85.00% is below the fp16 gate of 90%; to accept it, pass --min-token-agreement 0.85, or run in fp32" in fp16
    fp32 = ParityReport("ort", "fp32", {}, 1e-4, 1e-4, lost.graphs, [], {}, 0.97, 1.0).summary()
    assert "below the fp32 gate of 100%" in fp32 and "--bisect" in fp32 and "--min-token-agreement" not in fp32


def test_a_lower_gate_asked_for_is_judged_by_and_noted() -> None:
    report = int8_report(0.96875)
    report.accept_token_agreement(0.96, "--min-token-agreement")
    assert report.passed and report.token_agreement_required == 0.96
    assert "token agreement required: 96% (--min-token-agreement) in place of the int8 gate of 99%" in report.notes


def test_an_int8_report_has_no_atol_inf_anywhere() -> None:
    report = int8_report(0.96875, tilt=0.1)
    text = markdown(report)
    assert "inf" not in text.replace("Inf", "")  # the NaN/Inf column heading aside
    assert f"int8 gate: {GATES['int8'].removeprefix('int8: ')}" in text and "| n/a | n/a |" in text
    assert "**Tokens: token agreement 96.88% is below the int8 gate of 99%" in text
    assert "cosine min" in first_divergence(report) and "atol" not in first_divergence(report)
    fig = _plot_layer_norms(report, plt)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    plt.close(fig)
    assert labels and not any("atol" in label for label in labels), labels


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_a_bounded_report_states_its_tolerances(precision: str) -> None:
    from ldlm.export.layernorm.tolerances import tolerance

    atol, rtol = tolerance(precision)
    report = ParityReport(
        "ort", precision, {}, atol, rtol, [compare_outputs("encoder/random/latents", REF, REF, atol, rtol)], [], {}, 1.0, 0.8
    )
    text = markdown(report)
    assert f"An element fails when its error exceeds atol {atol:g} and rtol {rtol:g}." in text
    assert GATES[precision].removeprefix(f"{precision}: ") in text
