"""The PNG reports read as a reader needs them. Each figure is drawn from a small hand-made report
whose errors are known (NumPy arrays with set differences), then its axes are inspected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from ldlm.export.layernorm.compare import Comparison, compare_outputs  # noqa: E402
from ldlm.serve.checks.bench_report import bench_figure, plot_bench  # noqa: E402
from ldlm.serve.checks.parity_report import _plot_graphs, _plot_layer_norms, plot  # noqa: E402
from ldlm.serve.checks.parity_result import ParityReport  # noqa: E402

ATOL = RTOL = 1e-4


def comparison(name: str, error: float) -> Comparison:
    reference = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    return compare_outputs(name, reference, reference + np.float32(error), ATOL, RTOL)


@pytest.fixture
def report() -> ParityReport:
    graphs = [
        comparison(f"{g}/{inputs}/{output}", 1e-6)
        for g, output in (("decoder", "logits"), ("encoder", "latents"), ("denoiser", "x0_hat"))
        for inputs in ("random", "padded")
    ]
    layer_norms = [
        comparison("encoder:model.feature_model.h.0.ln_1/random", 1e-6),
        comparison("decoder:model.latent_decoder.query_mlp.norm/random", 0.0),
        comparison("decoder:model.token_decoder.norm/random", 1e-2),
    ]
    return ParityReport("ort", "fp32", {}, ATOL, RTOL, graphs, layer_norms)


def test_layer_norm_errors_name_modules_explain_zeros_and_legend_failures(report: ParityReport) -> None:
    assert [c.max_abs for c in report.layer_norms] == [pytest.approx(1e-6, rel=0.1), 0.0, pytest.approx(1e-2, rel=0.01)]
    assert [c.passed for c in report.layer_norms] == [True, True, False]
    fig = _plot_layer_norms(report, plt)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "encoder  feature_model.h.0.ln_1  (random inputs)",
        "decoder  latent_decoder.query_mlp.norm  (random inputs)",
        "decoder  token_decoder.norm  (random inputs)",
    ]
    bars = [(round(p.get_y() + p.get_height() / 2), p.get_facecolor()) for p in ax.patches]
    assert [y for y, _ in bars] == [0, 2], "the exactly-zero row must have no bar (it used to get a fake 1e-12 bar)"
    assert bars[0][1] != bars[1][1], "failed bars need their own colour"
    assert [t.get_text() for t in ax.texts] == ["0 (exactly equal)"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["passed", "failed", "atol 0.0001", "error exactly 0: no bar"]
    assert "red" not in ax.get_xlabel() + ax.get_ylabel()
    plt.close(fig)


def test_graph_histograms_in_pipeline_order_with_readable_legends(report: ParityReport) -> None:
    fig = _plot_graphs(report, plt)
    assert [ax.get_title() for ax in fig.axes] == ["encoder", "denoiser", "decoder"]
    for ax, output in zip(fig.axes, ("latents", "x0_hat", "logits")):
        legend = ax.get_legend()
        assert [t.get_text() for t in legend.get_texts()] == [f"random inputs -> {output}", f"padded inputs -> {output}", "atol 0.0001"]
        assert min(t.get_fontsize() for t in legend.get_texts()) >= 8
        assert len({line.get_linestyle() for line in ax.get_lines()[:2]}) == 2, "coinciding curves need distinct styles"
    plt.close(fig)


def bench_report(with_workload: bool) -> dict[str, Any]:
    cell = {"eager": {"p50_ms": 40.0}, "ort": {"p50_ms": 4.0}}
    report: dict[str, Any] = {"graphs": {"encoder/b1/L16": cell, "decoder/b1/L16": cell}}
    if with_workload:
        policy = {"tokens_per_s": 200.0, "latency_p50_s": 0.5, "latency_p99_s": 0.9}
        report["batching"] = {
            "backend": "ort",
            "requests": 12,
            "rate_per_s": 20.0,
            "max_batch": 8,
            "static": policy,
            "continuous": {**policy, "latency_p50_s": 0.6, "latency_p99_s": 0.7},
        }
    return report


def test_bench_without_workload_has_one_panel() -> None:
    fig = bench_figure(bench_report(False), plt)
    assert len(fig.axes) == 1
    plt.close(fig)


def test_bench_latency_axes_start_at_zero_or_say_they_do_not() -> None:
    fig = bench_figure(bench_report(True), plt)
    graph_ax, throughput_ax, latency_ax = fig.axes
    assert graph_ax.get_yscale() == "log" and "do not start at 0" in graph_ax.get_title()
    for ax in (throughput_ax, latency_ax):
        assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0
    assert [round(p.get_height(), 3) for p in latency_ax.patches] == [0.5, 0.9, 0.6, 0.7]
    assert [t.get_text() for t in latency_ax.get_xticklabels()] == ["static\np50", "static\np99", "continuous\np50", "continuous\np99"]
    plt.close(fig)


def test_png_files_are_written(report: ParityReport, tmp_path: Path) -> None:
    assert [p.name for p in plot(report, tmp_path)] == ["errors_by_graph.png", "errors_by_layernorm.png"]
    plot_bench(bench_report(False), str(tmp_path / "bench.png"))
    for name in ("errors_by_graph.png", "errors_by_layernorm.png", "bench.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plt.imread(tmp_path / "bench.png").shape[1] == 600, "one panel, 6 inches at 100 dpi"
